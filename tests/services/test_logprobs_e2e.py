"""Logprobs through the whole stack (gateway, Redis, verifier with EAGLE-3, drafter) and the OpenAI
client: chat and completions, streamed and not, raw and processed. The token strings join to the
text, and every value is in-process target-only decoding's within 1e-4."""

from __future__ import annotations

import openai
import pytest

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig
from specd.models.loader import load_tokenizer
from specd.sampling_params import SamplingParams
from specd.transport.embedded_redis import start_embedded_redis
from tests.services.test_e2e import start_stack

MAX_TOKENS = 16
TOLERANCE = 1e-4
MESSAGES = [{"role": "user", "content": "import json for value in data"}]
PROMPT = "def value(self, data):\n    return"


@pytest.fixture(scope="module")
def setup(tiny_models):
    model = tiny_models["target-llama"]
    server = start_embedded_redis()
    stack = start_stack(model, "eagle3", tiny_models["draft-eagle3"], server.url)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.server_port}/v1", api_key="x",
                           max_retries=0, timeout=120)
    try:
        yield model, client, client.models.list().data[0].id
    finally:
        stack.stop()
        server.stop()


def target_only(model, prompt_ids: list[int], num_top: int, mode: str):
    """In-process target-only greedy decoding's tokens and logprobs."""
    [seq] = build_engine(model, PytorchEngineConfig(max_batch_size=1)).generate(
        [prompt_ids], [SamplingParams(max_new_tokens=MAX_TOKENS, logprobs=num_top, logprobs_mode=mode)])
    return seq


def chat_prompt(tokenizer) -> list[int]:
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=True)


def check_chat(tokenizer, content: list, text: str, want) -> None:
    """content: the response's logprobs.content, one entry per output token."""
    assert len(content) == len(want.output_token_ids)
    assert "".join(c.token for c in content) == text
    for c, token, entry in zip(content, want.output_token_ids, want.output_logprobs):
        assert c.token == token_text(tokenizer, token) and c.bytes == list(c.token.encode())
        assert abs(c.logprob - max(entry.logprob, -9999.0)) <= TOLERANCE
        assert [t.token for t in c.top_logprobs] == [token_text(tokenizer, t) for t, _ in entry.top]
        for t, (_, lp) in zip(c.top_logprobs, entry.top):
            assert abs(t.logprob - max(lp, -9999.0)) <= TOLERANCE


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_chat_logprobs(setup, stream, mode):
    model, client, name = setup
    tokenizer = load_tokenizer(model)
    want = target_only(model, chat_prompt(tokenizer), 3, mode)
    kwargs = dict(model=name, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, logprobs=True,
                  top_logprobs=3, extra_body={"logprobs_mode": mode})
    if stream:
        text, content = "", []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.logprobs is not None:
                    content += choice.logprobs.content
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, content = choice.message.content, choice.logprobs.content
    assert text == tokenizer.decode(want.output_token_ids, skip_special_tokens=True)
    check_chat(tokenizer, content, text, want)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs(setup, stream):
    model, client, name = setup
    tokenizer = load_tokenizer(model)
    want = target_only(model, tokenizer.encode(PROMPT, add_special_tokens=True), 2, "raw")
    kwargs = dict(model=name, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    tokens, values, tops, offsets, text = [], [], [], [], ""
    choices = ([c for chunk in client.completions.create(stream=True, **kwargs) for c in chunk.choices] if stream
               else client.completions.create(**kwargs).choices)
    for choice in choices:
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            values += choice.logprobs.token_logprobs
            tops += choice.logprobs.top_logprobs
            offsets += choice.logprobs.text_offset
    assert text == tokenizer.decode(want.output_token_ids, skip_special_tokens=True)
    assert "".join(tokens) == text
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert tokens == [token_text(tokenizer, t) for t in want.output_token_ids]
    for value, top, token, entry in zip(values, tops, want.output_token_ids, want.output_logprobs):
        assert abs(value - entry.logprob) <= TOLERANCE
        expected = {token_text(tokenizer, t): lp for t, lp in [*entry.top, (token, entry.logprob)]}
        assert top.keys() == expected.keys()
        assert all(abs(top[k] - expected[k]) <= TOLERANCE for k in expected)


def test_no_logprobs_unless_asked(setup):
    model, client, name = setup
    reply = client.chat.completions.create(model=name, messages=MESSAGES, temperature=0, max_tokens=4)
    assert reply.choices[0].logprobs is None
    reply = client.completions.create(model=name, prompt=PROMPT, temperature=0, max_tokens=4)
    assert reply.choices[0].logprobs is None
