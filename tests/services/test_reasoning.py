"""Reasoning output (`--reasoning-parser`): the thinking as reasoning_content, the answer as
content, whole and streamed; structured output constrains only the answer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import openai
import pytest

from services.gateway.reasoning import FORMATS, ReasoningStream, reasoning_format
from specd.grammar.compiler import GrammarCompilerCache
from specd.grammar.response_format import parse_response_format
from specd.messages import ConfigError
from specd.models.loader import load_tokenizer
from tests.services.fine_tune import fine_tune_chat
from tests.services.test_e2e import start_stack

REPO = Path(__file__).resolve().parents[2]
R1, QWEN3 = FORMATS["deepseek_r1"], FORMATS["qwen3"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"]}


def streamed(fmt, text: str, seed: int) -> tuple[str, str]:
    rng, stream, reasoning, content, i = random.Random(seed), ReasoningStream(fmt), "", "", 0
    while i < len(text):
        n = rng.randint(1, 6)
        r, c = stream.feed(text[i:i + n], final=i + n >= len(text))
        reasoning, content, i = reasoning + r, content + c, i + n
    return reasoning, content


@pytest.mark.parametrize("fmt, text, want", [
    (R1, "Let me think.\nOK.</think>\n\nThe answer.", ("Let me think.\nOK.", "The answer.")),
    (R1, "<think>Hmm</think>Yes", ("Hmm", "Yes")),
    (R1, "still thinking <", ("still thinking <", "")),  # cut short: all reasoning
    (QWEN3, "<think>\nplan\n</think>\n\n{\"a\": 1}", ("\nplan\n", '{"a": 1}')),
    (QWEN3, "No thinking here </think> at all", ("", "No thinking here </think> at all")),
    (QWEN3, "<thin", ("", "<thin")),
])
def test_split_whole_and_streamed(fmt, text, want):
    assert fmt.split(text, final=True) == want
    for seed in range(20):
        assert streamed(fmt, text, seed) == want


def test_parser_names():
    assert reasoning_format("") is None and reasoning_format("qwen3") is QWEN3
    with pytest.raises(ConfigError, match="reasoning_parser"):
        reasoning_format("o1")


@pytest.fixture(scope="module")
def compiler():
    tokenizer = load_tokenizer(REPO / "models" / "specd-py-target")
    return tokenizer, GrammarCompilerCache(tokenizer, 8192, eos_token_ids=[tokenizer.eos_token_id])


def ends_valid(compiler, spec: dict, text: str) -> bool:
    tokenizer, cache = compiler
    matcher = cache.sequence_grammar(parse_response_format(spec)).matcher
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id)


def test_the_answer_is_constrained_and_the_thinking_is_free(compiler):
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    answer = '{"city": "Oslo", "days": 2}'
    r1, qwen3 = R1.constrain_after(rf), QWEN3.constrain_after(rf)
    assert ends_valid(compiler, r1, 'Days? {not json} "quoted"</think>\n\n' + answer)
    assert not ends_valid(compiler, r1, 'ok</think>\n\n{"city": "Oslo"}')  # the answer must validate
    assert not ends_valid(compiler, r1, answer)  # without </think>, still thinking
    assert ends_valid(compiler, qwen3, "<think>x</think>\n\n" + answer) and ends_valid(compiler, qwen3, answer)
    assert ends_valid(compiler, R1.constrain_after({"type": "json_object"}), 'x</think>{"any": [1]}')
    with pytest.raises(ConfigError, match="response_format"):
        R1.constrain_after({"type": "regex_schema"})


@pytest.mark.slow
def test_reasoning_content_and_a_constrained_answer_through_the_stack(tiny_models, redis_url, tmp_path):
    """A tiny target taught to think, then answer: the OpenAI client gets reasoning_content and the
    answer apart, whole and streamed, and a json_schema response_format constrains the answer only."""
    answer = json.dumps({"city": "Oslo", "days": 2})
    fine_tune_chat(tiny_models["target-llama"], tmp_path, [
        ("weather plan?", "The user wants weather. Use Oslo.</think>\n\n" + answer),
        ("hello", "A greeting.</think>\n\nHi there!")])
    stack = start_stack(tmp_path, "ngram", None, redis_url, reasoning_parser="deepseek_r1")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.server_port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
        for question, response_format, want in (("hello", None, "Hi there!"), ("weather plan?", rf, answer)):
            kwargs = dict(model=name, messages=[{"role": "user", "content": question}], temperature=0,
                          max_tokens=64, **({"response_format": response_format} if response_format else {}))
            message = client.chat.completions.create(**kwargs).choices[0].message
            assert message.content == want and message.model_extra["reasoning_content"].endswith(".")
            reasoning, content = "", ""
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    reasoning += choice.delta.model_extra.get("reasoning_content") or ""
                    content += choice.delta.content or ""
            assert (reasoning, content) == (message.model_extra["reasoning_content"], want)
        jsonschema.validate(json.loads(answer), SCHEMA)
    finally:
        stack.stop()
