"""The gateway against a real Redis, with the real openai client and a gRPC client.

The verifier's side of the Redis contract is played by a test-local responder thread: it
XREADGROUPs the request stream and answers with delta/final entries computed by a real in-process
engine (ngram speculation, greedy, so its tokens are the target's own and its spec_stats are real),
re-sending overlapping deltas on purpose so that delivery must be exactly-once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis

from services.gateway.core import GatewayConfig
from services.gateway.detokenize import IncrementalDetokenizer, StopStringFilter
from services.gateway.server import GatewayServer
from specd.messages import ConfigError, SpeculativeConfig
from specd.sampling_params import SamplingParams
from specd.transport.embedded_redis import free_port
from specd.transport.redis_streams import (CONSUMER_GROUP, RESULT_TTL_SECONDS, QueuedRequest,
                                           ResultEntry, result_key)
from specd.v1 import generate_pb2, generate_pb2_grpc

MODEL_NAME = "tiny-llama"
REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- the verifier's side of the contract ----------------------------------------------------------
class Responder(threading.Thread):
    """Plays a verifier: reads the request stream, writes deltas (with duplicates) and a final entry."""

    def __init__(self, redis_url: str, stream: str, engine, tokenizer, chunk: int = 3) -> None:
        super().__init__(daemon=True, name="test-responder")
        self.client = redis.Redis.from_url(redis_url)
        self.stream = stream
        self.engine = engine
        self.tokenizer = tokenizer
        self.chunk = chunk
        self.seen: dict[str, QueuedRequest] = {}
        self.abandoned: set[str] = set()  # by tests that disconnect
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            self.client.xgroup_create(self.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError:
            pass  # BUSYGROUP
        while not self.stop_event.is_set():
            try:
                reply = self.client.xreadgroup(CONSUMER_GROUP, "responder", {self.stream: ">"}, count=4, block=50)
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        self.answer(QueuedRequest.from_fields(fields))
                        self.client.xack(self.stream, CONSUMER_GROUP, entry_id)
                        self.client.xdel(self.stream, entry_id)
            except Exception as e:  # surfaced by the fixture's teardown
                self.errors.append(e)
                time.sleep(0.05)

    def write(self, request_id: str, entry: ResultEntry) -> None:
        key = result_key(request_id)
        with self.client.pipeline() as pipe:
            pipe.xadd(key, entry.to_fields())
            pipe.expire(key, RESULT_TTL_SECONDS)
            pipe.execute()

    def answer(self, req: QueuedRequest) -> None:
        self.seen[req.request_id] = req
        rid = req.request_id
        if "TRIGGER_ERROR" in self.tokenizer.decode(req.prompt_token_ids):
            self.write(rid, ResultEntry(kind="error", code=422, message="the verifier refused TRIGGER_ERROR"))
            return
        try:
            seq = self.engine.generate([req.prompt_token_ids], [req.params])[0]
        except ConfigError as e:
            self.write(rid, ResultEntry(kind="error", code=400, message=str(e)))
            return
        tokens = seq.output_token_ids
        last = max(1, len(tokens) % self.chunk or self.chunk)
        body = tokens[:-last]
        for i, pos in enumerate(range(0, len(body), self.chunk)):
            piece = body[pos:pos + self.chunk]
            self.write(rid, ResultEntry(kind="delta", pos=pos, tokens=piece))
            if i % 2 == 1:  # an overlapping re-send, as a resumed verifier would write
                back = max(0, pos - self.chunk)
                self.write(rid, ResultEntry(kind="delta", pos=back, tokens=body[back:pos + len(piece)]))
            time.sleep(0.002)
        if body:
            self.write(rid, ResultEntry(kind="delta", pos=0, tokens=body))  # a full duplicate
        self.write(rid, ResultEntry(kind="final", pos=len(body), tokens=tokens[len(body):],
                                    finish_reason=seq.finish_reason, spec_stats=seq.stats,
                                    prompt_tokens=len(req.prompt_token_ids)))


class ServiceLoop:
    """One background asyncio loop that runs every in-process gateway of this module."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="gateway-loop")
        self.thread.start()
        self.running: list[tuple[GatewayServer, object]] = []

    def start(self, config: GatewayConfig, grace_s: float = 1.0) -> GatewayServer:
        server = GatewayServer(config, host="127.0.0.1", port=0, grpc_port=0, grace_s=grace_s, access_log=False,
                               log_level="warning")
        future = asyncio.run_coroutine_threadsafe(server.serve(install_signal_handlers=False), self.loop)
        deadline = time.monotonic() + 30
        while not server.ready.wait(0.05):
            if future.done():
                future.result()
            assert time.monotonic() < deadline, "gateway did not start"
        self.running.append((server, future))
        return server

    def stop(self, server: GatewayServer) -> None:
        future = next(f for s, f in self.running if s is server)
        self.running.remove((server, future))
        server.shutdown()
        future.result(timeout=20)

    def close(self) -> None:
        for server, _ in list(self.running):
            self.stop(server)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_models) -> Path:
    return tiny_models["target-llama"]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from specd.models.loader import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Target-only greedy tokens: the truth the gateway's outputs are checked against."""
    from specd.engine.builder import build_engine

    engine = build_engine(model_dir)

    def generate(prompt_ids: list[int], max_tokens: int, **params) -> list[int]:
        return engine.generate([prompt_ids], [SamplingParams(max_new_tokens=max_tokens, **params)])[0].output_token_ids
    return generate


@pytest.fixture(scope="module")
def responder(redis_url, model_dir, tokenizer):
    from specd.engine.builder import build_engine

    engine = build_engine(model_dir, speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
                          tokenizer=tokenizer)
    thread = Responder(redis_url, "specd:requests", engine, tokenizer)
    thread.start()
    yield thread
    thread.stop_event.set()
    thread.join(timeout=5)
    assert not thread.errors, thread.errors


@pytest.fixture(scope="module")
def services():
    loop = ServiceLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def gateway(services, redis_url, model_dir, responder) -> GatewayServer:
    return services.start(GatewayConfig(model=str(model_dir), served_model_name=MODEL_NAME, redis_url=redis_url,
                                        max_queue_depth=64, request_timeout=30.0, enable_metrics=True))


@pytest.fixture(scope="module")
def base_url(gateway) -> str:
    return f"http://127.0.0.1:{gateway.port}"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def stub(gateway):
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}")
    yield generate_pb2_grpc.GenerateStub(channel)
    channel.close()


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fibonacci(n):"}]


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
        response_format={"type": "json_object"},
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [7],
                    "ignore_eos": True})
    params = responder.seen[resp.id.removeprefix("chatcmpl-")].params
    assert params.temperature == 1.0  # OpenAI's default, sampled
    assert (params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (0.9, 20, 0.05, 1.1)
    assert params.seed == 1234 and params.max_new_tokens == 8 and params.ignore_eos
    assert params.stop_words == ["\n\n", "END"] and params.stop_token_ids == [7]
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
    ({"n": 2}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": 5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"messages": []}, "messages"),
    ({"top_p": 1.5}, "top_p"),
    ({"logprobs": True}, "logprobs"),
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
    (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p",'
     b' "q", "r", "s", "t", "u", "v", "w", "x", "y", "z", "1", "2", "3", "4", "5", "6", "7", "8", "9", "0", "A",'
     b' "B", "C", "D", "E", "F", "G", "H", "I", "J", "K", "L", "M", "N", "O", "P", "Q", "R", "S", "T", "U", "V",'
     b' "W", "X", "Y", "Z", "!", "?", "."]}', "stop", "at most 64"),
    (b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": '
     + b'[' * 70 + b']' * 70 + b'}}}', "response_format", "nested"),
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


# ---- gRPC -------------------------------------------------------------------------------------------------
def test_grpc_generate_is_exactly_once(stub, tokenizer, reference):
    prompt_ids = tokenizer.encode("for i in range(", add_special_tokens=True)
    expected = reference(prompt_ids, 33)
    request = generate_pb2.GenerateRequest(model=MODEL_NAME, token_ids=generate_pb2.TokenIds(ids=prompt_ids),
                                           max_tokens=33)
    resp = stub.Generate(request, timeout=30)
    assert list(resp.token_ids) == expected  # duplicated deltas were dropped
    assert resp.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert resp.finish_reason in (generate_pb2.FINISH_REASON_LENGTH, generate_pb2.FINISH_REASON_STOP)
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == len(expected)
    assert 0 < resp.usage.time_to_first_token_us <= resp.usage.latency_us
    assert resp.spec_stats.num_drafts > 0 and len(resp.id) == 32

    deltas = list(stub.GenerateStream(request, timeout=30))
    assert [t for d in deltas for t in d.token_ids] == expected
    assert "".join(d.text for d in deltas) == resp.text
    assert deltas[-1].finish_reason == resp.finish_reason and deltas[-1].spec_stats == resp.spec_stats
    assert all(d.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for d in deltas[:-1])

    chat = stub.Generate(generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(**m) for m in MESSAGES]), max_tokens=12), timeout=30)
    assert list(chat.token_ids) == reference(chat_prompt_ids(tokenizer, MESSAGES), 12)


def test_grpc_errors_health_and_reflection(stub, gateway):
    def code_of(call, request):
        with pytest.raises(grpc.RpcError) as info:
            result = call(request, timeout=10)
            if not isinstance(result, generate_pb2.GenerateResponse):
                list(result)
        return info.value.code(), info.value.details()

    assert code_of(stub.Generate, generate_pb2.GenerateRequest(model="nope", text="x"))[0] == grpc.StatusCode.NOT_FOUND
    assert code_of(stub.Generate, generate_pb2.GenerateRequest(max_tokens=3))[0] == grpc.StatusCode.INVALID_ARGUMENT
    code, details = code_of(stub.GenerateStream, generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[5] * 4096)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "context length" in details
    code, _ = code_of(stub.Generate, generate_pb2.GenerateRequest(
        text="x", sampling={"temperature": -1.0}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, details = code_of(stub.Generate, generate_pb2.GenerateRequest(
        text="x", sampling={"temperature": float("nan")}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "finite" in details
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        for method in (channel.unary_unary("/specd.v1.Generate/Generate"),
                       channel.unary_stream("/specd.v1.Generate/GenerateStream")):
            code, details = code_of(method, b"\x12\x02\xff\xfe")  # text field, bytes that are not UTF-8
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf" in details
    code, details = code_of(stub.GenerateStream, generate_pb2.GenerateRequest(text="TRIGGER_ERROR", max_tokens=3))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "refused" in details  # the verifier's 422

    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="specd.v1.Generate"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(replies).list_services_response.service}
        assert "specd.v1.Generate" in names and "grpc.health.v1.Health" in names


# ---- the Redis side ---------------------------------------------------------------------------------------
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


def _samples(base_url) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_equal_the_sum_of_spec_stats(client, base_url):
    labels = (("model_name", MODEL_NAME),)
    before = _samples(base_url)
    stats = []
    for prompt in ("def add(a, b):", "while True:", "x = [1, 2, 3]"):
        resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=32, temperature=0)
        stats.append(resp.model_extra["spec_stats"])
    after = _samples(base_url)

    def delta(name: str, extra: tuple = ()) -> float:
        key = (name, tuple(sorted(labels + extra)))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("specd:spec_decode_num_drafts_total") == sum(s["num_drafts"] for s in stats) > 0
    assert delta("specd:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in stats)
    assert delta("specd:spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_tokens"] for s in stats)
    for pos in range(3):
        assert delta("specd:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(pos)),)) == sum(
            s["accepted_per_position"][pos] for s in stats if len(s["accepted_per_position"]) > pos)
    drafts = after[("specd:spec_decode_num_drafts_total", labels)]
    accepted = after[("specd:spec_decode_num_accepted_tokens_total", labels)]
    assert after[("specd:spec_decode_mean_acceptance_length", labels)] == pytest.approx(1 + accepted / drafts)
    assert after[("specd:spec_decode_mean_acceptance_rate", labels)] == pytest.approx(
        accepted / after[("specd:spec_decode_num_draft_tokens_total", labels)])
    finished = sum(delta("specd:request_success_total", (("finished_reason", r),)) for r in ("stop", "length"))
    assert finished == 3
    assert delta("specd:time_to_first_token_seconds_count") == 3
    assert delta("specd:e2e_request_latency_seconds_count") == 3
    assert ("specd:request_queue_depth", labels) in after and ("specd:request_queue_pending", labels) in after


# ---- backpressure, timeouts, Redis down -------------------------------------------------------------------
def test_timeout_then_queue_full(services, redis_url, model_dir):
    stream = "test:unanswered"
    server = services.start(GatewayConfig(model=str(model_dir), redis_url=redis_url, request_stream=stream,
                                          max_queue_depth=2, request_timeout=0.5))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=str(model_dir), prompt="x", max_tokens=4)
    assert info.value.status_code == 504 and time.monotonic() - started < 5
    r = redis.Redis.from_url(redis_url)
    assert r.xlen(stream) == 1  # accepted before the timeout: it stays for a verifier (deadline set)
    assert json.loads(r.xrange(stream)[0][1][b"body"])["deadline"] is not None
    # gRPC: the client's shorter deadline is the request's deadline (queued with it, answered at it).
    stub = generate_pb2_grpc.GenerateStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(generate_pb2.GenerateRequest(text="x", max_tokens=4), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 2
    queued = [json.loads(fields[b"body"]) for _, fields in r.xrange(stream)]
    assert len(queued) == 2 and queued[1]["deadline"] - queued[1]["arrival_time"] < 1.0
    r.xdel(stream, r.xrange(stream)[1][0])
    r.xadd(stream, {"id": "filler", "body": "{}"})
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=str(model_dir), prompt="x", max_tokens=4)
    assert info.value.response.headers["retry-after"] == "1"
    assert r.xlen(stream) == 2


def test_graceful_shutdown_finishes_requests_in_flight(services, redis_url, model_dir, responder, tokenizer,
                                                       reference):
    server = services.start(GatewayConfig(model=str(model_dir), redis_url=redis_url, request_timeout=30.0),
                            grace_s=10.0)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    prompt_ids = tokenizer.encode("async def ", add_special_tokens=True)
    seen_before = set(responder.seen)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: client.completions.create(model=str(model_dir), prompt=prompt_ids,
                                                                max_tokens=60, temperature=0))
        deadline = time.monotonic() + 10
        while set(responder.seen) == seen_before and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not pending.done()
        services.stop(server)  # returns once the servers stopped; the request in flight was answered
        assert pending.result(timeout=10).choices[0].text == tokenizer.decode(reference(prompt_ids, 60),
                                                                              skip_special_tokens=True)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=2)


def test_redis_down_answers_503_and_sigterm_stops(model_dir):
    """The real command line, pointed at a closed port: quick 503s, then a clean SIGTERM shutdown."""
    port, grpc_port, redis_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specd.cli", "gateway", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
         "--grpc-port", str(grpc_port), "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--log-level",
         "warning"], cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(base + "/health", timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                time.sleep(0.1)
        assert health.status_code == 503
        started = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable"
        assert time.monotonic() - started < 2.0
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                generate_pb2_grpc.GenerateStub(channel).Generate(generate_pb2.GenerateRequest(text="x"), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
