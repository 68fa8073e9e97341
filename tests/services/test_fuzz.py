"""Fuzz: malformed HTTP and gRPC requests against a running stack (gateway, verifier, grammar).

Hypothesis draws request bodies whose every field may be wrong (wrong type, out of range, NaN,
lone surrogates, deep nesting, unknown model), raw bytes with random content types, random bytes
and mutated protobuf for the gRPC methods, and GenerateRequests with hostile field values. Every
answer must be a 2xx or a 4xx with OpenAI's error body (a gRPC status other than INTERNAL or
UNKNOWN); afterwards no process has died and a normal request returns the target's own greedy
tokens. Examples are derandomized: CI sees the same ones every run.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import grpc
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.launcher.supervisor import Stack, StackConfig
from specd.transport.ports import free_port
from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc

SESSION_LEN = 48  # short contexts: every request the fuzz gets accepted finishes quickly
MODEL_NAME = "fuzz-model"
COUNTS: Counter = Counter()  # kind -> requests sent; status -> answers
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def stack(tiny_models, redis_url):
    config = StackConfig(model=str(tiny_models["target-llama"]), server_name="127.0.0.1", server_port=free_port(),
                         grpc_port=free_port(), redis_url=redis_url, max_batch_size=8, session_len=SESSION_LEN,
                         served_model_name=MODEL_NAME, request_timeout=60, max_request_bytes=64 << 10)
    running = Stack(config)
    try:
        running.start(timeout=240)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=f"http://127.0.0.1:{stack.config.server_port}", timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        yield ch


# ---- strategies -----------------------------------------------------------------------------------------
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                      st.just("\ud800"))  # a lone surrogate: valid JSON (as an escape), invalid text
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)
deep = st.integers(min_value=60, max_value=400).map(lambda n: {"type": "json_schema", "json_schema": {
    "schema": json.loads("[" * n + "]" * n) if n % 2 else _nested_schema(n)}})


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def maybe(valid, *invalid):
    """A field that is valid, wrong in a specific way, or arbitrary JSON."""
    return st.one_of(valid, *invalid, json_value)


messages = maybe(st.just([{"role": "user", "content": "Shanghai is"}]),
                 st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                                 "content": st.one_of(st.text(max_size=40), st.just("\udc80"),
                                                                      st.lists(json_value, max_size=2))}),
                          max_size=3))
common_fields = {
    "model": maybe(st.just(MODEL_NAME), st.text(max_size=10)),
    "max_tokens": maybe(st.integers(min_value=1, max_value=8), st.integers(min_value=-2**40, max_value=2**40)),
    "temperature": maybe(st.just(0.0), st.floats(min_value=-1, max_value=3)),
    "top_p": maybe(st.floats(min_value=0, max_value=1), st.floats()),
    "top_k": maybe(st.integers(min_value=-2, max_value=50)),
    "min_p": maybe(st.floats(min_value=0, max_value=1), st.floats()),
    "repetition_penalty": maybe(st.floats(min_value=0.5, max_value=2), st.floats()),
    "seed": maybe(st.integers(min_value=-2**80, max_value=2**80)),
    "stop": maybe(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=70)),
    "stop_token_ids": maybe(st.lists(st.integers(min_value=-5, max_value=10**6), max_size=4)),
    "n": maybe(st.just(1), st.integers(min_value=-3, max_value=3)),
    "stream": maybe(st.booleans()),
    "ignore_eos": maybe(st.booleans()),
    "min_tokens": maybe(st.integers(min_value=-2, max_value=10**9)),
    "response_format": maybe(st.just({"type": "json_object"}), st.just({"type": "regex_schema", "regex_schema": "(["}),
                             deep),
    "logprobs": maybe(st.just(False)),
    "logprobs_mode": maybe(st.just("raw"), st.just("processed"), st.text(max_size=4)),
    "stream_options": maybe(st.just({"include_usage": True})),
}


def request_body(required: dict):
    """Any subset of the common fields (each possibly wrong) plus the endpoint's own."""
    optional = st.fixed_dictionaries({}, optional={**common_fields})
    return st.tuples(st.fixed_dictionaries({}, optional=required), optional).map(lambda t: {**t[1], **t[0]})


chat_body = request_body({"messages": messages, "chat_template_kwargs": json_value,
                          "max_completion_tokens": maybe(st.integers(min_value=-1, max_value=8))})
completion_body = request_body({"prompt": maybe(st.text(max_size=30), st.just("\ud83d"),
                                                st.lists(st.integers(min_value=-10, max_value=10**6), max_size=8),
                                                st.lists(st.text(max_size=5), max_size=2)),
                                "echo": maybe(st.booleans()), "suffix": maybe(st.text(max_size=3))})

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/x", "/health", "/v1/nothing", "/"]
raw_request = st.tuples(
    st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]), st.sampled_from(ROUTES),
    st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", "", "application/json; charset=latin-1"]),
    st.one_of(st.binary(max_size=200),
              st.just(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),  # invalid UTF-8
              st.just(b'{"prompt": "x", "max_tokens": 2'),  # truncated
              st.just(b"[" * 5000 + b"]" * 5000),  # deeply nested
              st.just(b"{" + b'"a":1,' * 20000 + b'"prompt":"x"}'),  # over the 64 KiB body limit
              json_value.map(lambda v: json.dumps(v).encode())))


# ---- checks ------------------------------------------------------------------------------------------------
def check_http(response: httpx.Response) -> None:
    COUNTS[f"http {response.status_code}"] += 1
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], error
    if response.status_code == 200 and "text/event-stream" in response.headers.get("content-type", ""):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in map(json.loads, events[:-1]):  # an error after the headers travels in-band
            assert "error" not in event or event["error"]["type"] == "invalid_request_error", event


def post_json(http: httpx.Client, path: str, body) -> httpx.Response:
    # allow_nan: Python's json (which the gateway uses) reads NaN and Infinity; clients may send them.
    # ensure_ascii (the default) writes lone surrogates as \ud800 escapes, as a JavaScript client would.
    data = json.dumps(body, allow_nan=True).encode()
    return http.post(path, content=data, headers={"content-type": "application/json"})


@FUZZ
@given(body=chat_body)
def test_fuzz_chat_completions(http, body):
    COUNTS["http requests"] += 1
    check_http(post_json(http, "/v1/chat/completions", body))


@FUZZ
@given(body=completion_body)
def test_fuzz_completions(http, body):
    COUNTS["http requests"] += 1
    check_http(post_json(http, "/v1/completions", body))


@settings(FUZZ, max_examples=500)
@given(request=raw_request)
def test_fuzz_raw_http(http, request):
    method, path, content_type, data = request
    COUNTS["http requests"] += 1
    headers = {"content-type": content_type} if content_type else {}
    check_http(http.request(method, path, content=data, headers=headers))


# ---- gRPC ------------------------------------------------------------------------------------------------
ALLOWED_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
VALID = generate_pb2.GenerateRequest(model=MODEL_NAME, text="def f(x):", max_tokens=4).SerializeToString()
grpc_bytes = st.one_of(
    st.binary(max_size=300),
    st.tuples(st.integers(min_value=0, max_value=len(VALID) - 1), st.binary(min_size=1, max_size=4)).map(
        lambda t: VALID[:t[0]] + t[1] + VALID[t[0] + len(t[1]):]),  # a valid request with bytes overwritten
    st.integers(min_value=1, max_value=len(VALID) - 1).map(lambda n: VALID[:n]))  # truncated


def call_raw(channel, method: str, payload: bytes) -> grpc.StatusCode:
    try:
        if method == "Generate":
            channel.unary_unary("/specd.v1.Generate/Generate")(payload, timeout=60)
        else:
            list(channel.unary_stream("/specd.v1.Generate/GenerateStream")(payload, timeout=60))
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        assert e.code() in ALLOWED_CODES, (e.code(), e.details())
        assert e.details(), e.code()
        return e.code()


@settings(FUZZ, max_examples=300)
@given(payload=grpc_bytes, method=st.sampled_from(["Generate", "GenerateStream"]))
def test_fuzz_grpc_bytes(channel, payload, method):
    COUNTS["grpc requests"] += 1
    COUNTS[f"grpc {call_raw(channel, method, payload).name}"] += 1


floats = st.floats(width=32)
grpc_request = st.builds(
    lambda model, kind, text, ids, max_tokens, sampling, stop, stop_ids, has_seed, fmt: generate_pb2.GenerateRequest(
        model=model, max_tokens=max_tokens, sampling=sampling, stop=stop, stop_token_ids=stop_ids,
        has_seed=has_seed, response_format_json=fmt,
        **({"text": text} if kind == 0 else {"token_ids": generate_pb2.TokenIds(ids=ids)} if kind == 1 else
           {"chat": generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content=text)])}
           if kind == 2 else {})),
    st.one_of(st.just(""), st.just(MODEL_NAME), st.text(max_size=8)), st.integers(0, 3), st.text(max_size=30),
    st.lists(st.integers(min_value=-2**63, max_value=2**63 - 1), max_size=6),
    st.one_of(st.integers(0, 8), st.integers(-2**31, 2**31 - 1)),
    st.builds(common_pb2.SamplingParameters, temperature=floats, top_k=st.integers(-2**31, 2**31 - 1),
              top_p=floats, min_p=floats, repetition_penalty=floats, seed=st.integers(0, 2**64 - 1)),
    st.lists(st.text(max_size=3), max_size=70), st.lists(st.integers(-2**63, 2**63 - 1), max_size=4),
    st.booleans(),
    st.one_of(st.just(""), st.just('{"type": "json_object"}'), st.text(max_size=20), json_value.map(json.dumps)))


@settings(FUZZ, max_examples=300)
@given(request=grpc_request, method=st.sampled_from(["Generate", "GenerateStream"]))
def test_fuzz_grpc_fields(channel, request, method):
    COUNTS["grpc requests"] += 1
    COUNTS[f"grpc {call_raw(channel, method, request.SerializeToString()).name}"] += 1


# ---- afterwards ---------------------------------------------------------------------------------------------
def test_after_the_fuzz_nothing_died_and_answers_are_right(stack, tiny_models):
    from specd.engine.builder import build_engine
    from specd.models.loader import load_tokenizer
    from specd.sampling_params import SamplingParams

    print(f"\nfuzz counts: {dict(sorted(COUNTS.items()))}")
    assert COUNTS["http requests"] >= 1000 and COUNTS["grpc requests"] >= 600, COUNTS
    assert not any(k.startswith("http 5") for k in COUNTS), COUNTS
    assert COUNTS["http 200"] > 0 and COUNTS["http 400"] > 0 and COUNTS["grpc OK"] > 0  # both kinds were hit
    for name, proc in stack.children:
        assert proc.poll() is None, f"{name} died during the fuzz (exit {proc.returncode})"

    model = tiny_models["target-llama"]
    tokenizer = load_tokenizer(model)
    prompt = tokenizer.encode("def fibonacci(n):", add_special_tokens=True)
    expected = build_engine(model).generate([prompt], [SamplingParams(max_new_tokens=16)])[0].output_token_ids
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.server_port}/v1", api_key="x", max_retries=0,
                           timeout=60)
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        out = generate_pb2_grpc.GenerateStub(ch).Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=16), timeout=60)
    assert list(out.token_ids) == expected
    assert math.isfinite(out.usage.latency_us)
