"""The gateway's OpenAI-compatible HTTP API against a real Redis, with the real openai client.

The verifier's side is a test-local responder (tests/services/gateway_harness.py) that answers
from a real in-process engine and re-sends deltas on purpose, so delivery must be exactly-once.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from services.gateway.core import GatewayConfig
from services.gateway.detokenize import IncrementalDetokenizer, StopStringFilter
from specd.transport.redis_streams import RESULT_TTL_SECONDS, result_key

# the fixtures by name (pytest finds them in this module; a fixture's own arguments too)
from tests.services.gateway_harness import (  # noqa: F401
    model_dir, tokenizer, reference, responder, services, gateway, base_url, client, stub,
    MODEL_NAME, MESSAGES, chat_prompt_ids)


# ---- pure pieces --------------------------------------------------------------------------------------
def test_incremental_detokenizer_matches_full_decode(tokenizer, reference):
    tokens = reference(tokenizer.encode("import json\n"), 40)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([t]) for t in tokens]
    deltas.append(detok.finish())
    assert "".join(deltas) == tokenizer.decode(tokens, skip_special_tokens=True)
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_stop_string_filter_holds_back_partial_matches():
    f = StopStringFilter(["STOP", "##"])
    out = [f.push("abc ST"), f.push("O"), f.push("x #"), f.push("#tail")]
    assert out == ["abc ", "", "STOx ", ""] and f.is_stopped
    f = StopStringFilter(["STOP"], include_stop_str=True)
    assert f.push("aSTOPb") == "aSTOP"
    f = StopStringFilter(["STOP"])
    assert f.push("aST") == "a" and f.push("", is_final=True) == "ST"


# ---- HTTP ----------------------------------------------------------------------------------------------
def test_models_and_health(client, base_url):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(base_url + "/health").status_code == 200


def test_chat_completion_matches_engine(client, tokenizer, reference):
    expected = reference(chat_prompt_ids(tokenizer, MESSAGES), 24)
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if len(expected) == 24 else "stop")
    assert resp.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, MESSAGES))
    assert resp.usage.completion_tokens == len(expected)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + len(expected)
    assert resp.object == "chat.completion" and resp.model == MODEL_NAME and resp.id.startswith("chatcmpl-")
    stats = resp.model_extra["spec_stats"]
    assert stats["num_drafts"] > 0 and stats["mean_acceptance_length"] >= 1.0
    assert set(stats) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
                          "mean_acceptance_length"}


def test_chat_stream_with_usage(client, tokenizer, reference):
    expected = reference(chat_prompt_ids(tokenizer, MESSAGES), 40)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=40,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1, "expected several deltas"
    assert "".join(texts) == tokenizer.decode(expected, skip_special_tokens=True)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].model_extra["spec_stats"]["num_draft_tokens"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    assert chunks[-1].model_extra["spec_stats"] == finish[0].model_extra["spec_stats"]  # beside the usage too
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_ids(client, tokenizer, reference):
    prompt_ids = tokenizer.encode("class Stack:\n", add_special_tokens=True)
    expected = tokenizer.decode(reference(prompt_ids, 30), skip_special_tokens=True)
    by_text = client.completions.create(model=MODEL_NAME, prompt="class Stack:\n", max_tokens=30, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=30, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text == expected
    assert by_ids.object == "text_completion" and by_ids.usage.prompt_tokens == len(prompt_ids)
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=30, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in streamed)


def test_stop_string_cuts_text(client, tokenizer, reference):
    prompt_ids = tokenizer.encode("def main():\n", add_special_tokens=True)
    full = tokenizer.decode(reference(prompt_ids, 48), skip_special_tokens=True)
    start = next(i for i in range(4, len(full) - 3) if full[i:i + 2].isascii() and full[i:i + 2].strip()
                 and full[i:i + 2].isprintable())
    stop = full[start:start + 2]
    want = full[:full.find(stop)]
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=48, temperature=0, stop=[stop])
    assert resp.choices[0].text == want and resp.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=48, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_parameters_reach_the_queue(client, responder):
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, top_p=0.9, seed=1234, stop=["\n\n", "END"],
        response_format={"type": "json_object"}, presence_penalty=0.5, frequency_penalty=-0.25,
        logit_bias={"7": 3, "11": -100},
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [7],
                    "ignore_eos": True})
    params = responder.seen[resp.id.removeprefix("chatcmpl-")].params
    assert params.temperature == 1.0  # OpenAI's default, sampled
    assert (params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (0.9, 20, 0.05, 1.1)
    assert params.seed == 1234 and params.max_new_tokens == 8 and params.ignore_eos
    assert params.stop_words == ["\n\n", "END"] and params.stop_token_ids == [7]
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (0.5, -0.25, {7: 3.0, 11: -100.0})
    assert responder.seen[resp.id.removeprefix("chatcmpl-")].response_format == {"type": "json_object"}
    seeds = {responder.seen[client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).id
                            .removeprefix("cmpl-")].params.seed for _ in range(2)}
    assert len(seeds) == 2  # drawn per request when absent
    greedy = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, temperature=0)
    assert responder.seen[greedy.id.removeprefix("cmpl-")].params.is_greedy


def test_concurrent_requests_share_one_reader(client, tokenizer, reference):
    prompts = [tokenizer.encode(f"value_{i} = ", add_special_tokens=True) for i in range(8)]
    expected = [tokenizer.decode(reference(p, 20), skip_special_tokens=True) for p in prompts]

    def run(p):
        return client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=20, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, prompts)) == expected


def test_verifier_error_entry_keeps_its_code(client):
    with pytest.raises(openai.UnprocessableEntityError, match="refused TRIGGER_ERROR"):
        client.completions.create(model=MODEL_NAME, prompt="TRIGGER_ERROR", max_tokens=4)
    with pytest.raises(openai.UnprocessableEntityError):
        list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "TRIGGER_ERROR"}],
                                            max_tokens=4, stream=True))


@pytest.mark.parametrize("body, param", [
    ({"n": 17}, "n"), ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": 5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"messages": []}, "messages"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true, as OpenAI
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": "yes please"}, "logprobs"),
    ({"logprobs": True, "logprobs_mode": "logits"}, "logprobs_mode"),
    ({"max_tokens": 5000}, "max_tokens"),
])
def test_bad_chat_requests_are_400(base_url, body, param):
    r = httpx.post(base_url + "/v1/chat/completions",
                   json={"model": MODEL_NAME, "messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"].startswith(param), error


def test_malformed_and_oversized_requests(base_url, client):
    r = httpx.post(base_url + "/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": [5] * 4096})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": [5, 100000]})
    assert r.status_code == 400
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": ["a", "b"]})
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    r = httpx.get(base_url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize("raw, param, says", [
    (b'{"prompt": "\\ud800 x", "max_tokens": 2}', "prompt", "UTF-8"),  # a lone surrogate escape
    (b'{"prompt": "x", "temperature": NaN}', "temperature", "finite"),
    (b'{"prompt": "x", "repetition_penalty": Infinity}', "repetition_penalty", "finite"),
    (b'{"prompt": "x", "stop_token_ids": [-1]}', "stop_token_ids", ">= 0"),
    (b'{"prompt": "x", "stop_token_ids": [100000]}', "stop_token_ids", "token ids must be in"),
    (b'{"prompt": "x", "echo": true}', "echo", "not supported"),
    (b'{"prompt": "x", "best_of": 3}', "best_of", "best_of must be 1"),
    (b'{"prompt": "x", "suffix": "end"}', "suffix", "not supported"),
    (b'{"prompt": "x", "presence_penalty": 2.5}', "presence_penalty", "less than or equal to 2"),
    (b'{"prompt": "x", "frequency_penalty": -3}', "frequency_penalty", "greater than or equal to -2"),
    (b'{"prompt": "x", "logit_bias": {"x": 1}}', "logit_bias", "keys must be token ids"),
    (b'{"prompt": "x", "logit_bias": {"5": 101}}', "logit_bias", "[-100, 100]"),
    (b'{"prompt": "x", "logit_bias": {"100000": 1}}', "logit_bias", "token ids must be in"),
    (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p",'
     b' "q", "r", "s", "t", "u", "v", "w", "x", "y", "z", "1", "2", "3", "4", "5", "6", "7", "8", "9", "0", "A",'
     b' "B", "C", "D", "E", "F", "G", "H", "I", "J", "K", "L", "M", "N", "O", "P", "Q", "R", "S", "T", "U", "V",'
     b' "W", "X", "Y", "Z", "!", "?", "."]}', "stop", "at most 64"),
    (b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": '
     + b'[' * 70 + b']' * 70 + b'}}}', "response_format", "nested"),
    (b'{"prompt": "x", "logprobs": 6}', "logprobs", "less than or equal to 5"),
    (b'{"prompt": "x", "logprobs": -1}', "logprobs", "greater than or equal to 0"),
    (b'{"prompt": "x", "logprobs": 1, "logprobs_mode": "raw_logits"}', "logprobs_mode", "raw"),
    (b'[1, 2]', None, "JSON object"),
    (b'{"prompt": "\xff\xfe"}', None, "UTF-8"),  # bytes that are not UTF-8
])
def test_bad_values_are_400_naming_the_field(base_url, responder, raw, param, says):
    before = len(responder.seen)
    r = httpx.post(base_url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"] or "").split(".")[0] == (param or "") and says in error["message"], error
    assert len(responder.seen) == before  # nothing was queued


def test_oversized_bodies_are_413_before_reading(base_url):
    limit = GatewayConfig(model="m").max_request_bytes
    big = b'{"prompt": "' + b"a" * limit + b'"}'
    r = httpx.post(base_url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(limit // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = httpx.post(base_url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_client_disconnect_stops_reading(base_url, gateway, responder, redis_url, caplog):
    caplog.set_level(logging.INFO, logger="services.gateway.core")
    reader = gateway.gateway.reader
    with httpx.stream("POST", base_url + "/v1/completions",
                      json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 200, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        next(r.iter_lines())
    responder.abandoned.add(request_id)
    deadline = time.monotonic() + 5
    while reader.num_active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert reader.num_active == 0
    assert f"request {request_id} abandoned: client disconnected" in caplog.text  # the cancellation hook ran
    # The verifier is not told yet (a later issue): what it still writes expires by TTL.
    ttl = redis.Redis.from_url(redis_url).ttl(result_key(request_id))
    assert ttl == -2 or 0 < ttl <= RESULT_TTL_SECONDS


# ---- after the tests above: every answered request's result stream is gone ------------------------
def test_result_streams_are_deleted(client, redis_url, responder):
    client.completions.create(model=MODEL_NAME, prompt="import os\n", max_tokens=5, temperature=0)
    r = redis.Redis.from_url(redis_url)
    answered = [rid for rid in responder.seen if rid not in responder.abandoned]
    assert len(answered) > 10
    assert [rid for rid in answered if r.exists(result_key(rid))] == []
    deadline = time.monotonic() + 3
    while r.xlen("specd:requests") and time.monotonic() < deadline:  # the responder XDELs after its final
        time.sleep(0.02)
    assert r.xlen("specd:requests") == 0


def test_n_choices_greedy_sampled_and_streamed(client, tokenizer, reference):
    """n > 1: one request per choice, each an independent draw (oai.choice_seed); choice 0 is the
    n = 1 answer with the same seed; streamed choices reassemble by index; usage sums them."""
    expected = reference(chat_prompt_ids(tokenizer, MESSAGES), 12)
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert all(c.message.content == tokenizer.decode(expected, skip_special_tokens=True) for c in greedy.choices)
    assert greedy.usage.completion_tokens == 3 * len(expected)

    one = client.completions.create(model=MODEL_NAME, prompt="def", max_tokens=16, temperature=1.0, seed=7)
    many = client.completions.create(model=MODEL_NAME, prompt="def", max_tokens=16, temperature=1.0, seed=7, n=4)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == one.choices[0].text and len({c.text for c in many.choices}) >= 3
    streamed = client.completions.create(model=MODEL_NAME, prompt="def", max_tokens=16, temperature=1.0, seed=7, n=4,
                                         stream=True, stream_options={"include_usage": True})
    texts, usage = {}, None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert [texts[i] for i in range(4)] == [c.text for c in many.choices]
    assert usage.completion_tokens == many.usage.completion_tokens


def test_choice_seeds_draw_independent_samples():
    """Choices' seeds give draws that follow the distribution and are independent of each other:
    the joint of choices 0 and 1 over 4,000 requests against p x p (chi-square), the same test
    failing for seeds that collide (a planted bug)."""
    import numpy as np
    import torch
    from scipy.stats import chisquare

    from services.gateway.openai_api import choice_seed
    from specd.random import SALT_SAMPLE
    from specd.sampling import sample_from_probs

    p = torch.tensor([0.4, 0.3, 0.2, 0.1])

    def joint_pvalue(seed_of) -> float:
        seeds = torch.tensor([seed_of(s, i) for s in range(4000) for i in (0, 1)])
        draws = sample_from_probs(p.expand(len(seeds), 4).contiguous(), seeds, torch.full((len(seeds),), 5),
                                  SALT_SAMPLE).view(-1, 2)
        counts = np.zeros((4, 4))
        for a, b in draws.tolist():
            counts[a, b] += 1
        expected = np.outer(p.double().numpy(), p.double().numpy()).ravel()
        expected = expected / expected.sum() * counts.sum()
        return chisquare(counts.ravel(), expected).pvalue

    assert joint_pvalue(lambda s, i: choice_seed(1000 + s, i)) > 1e-3
    assert joint_pvalue(lambda s, i: 1000 + s) < 1e-6  # every choice the same draw
