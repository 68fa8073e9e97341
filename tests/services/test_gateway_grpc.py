"""The gateway's gRPC API, its result streams and metrics, and its lifecycle (timeouts, a full
queue, graceful shutdown, Redis down) against a real Redis; the verifier's side is the test-local
responder of tests/services/gateway_harness.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import redis

from services.gateway.core import GatewayConfig
from specd.transport.ports import free_port
from specd.v1 import generate_pb2, generate_pb2_grpc
# the fixtures by name (pytest finds them in this module; a fixture's own arguments too)
from tests.services.gateway_harness import (  # noqa: F401
    model_dir, tokenizer, reference, responder, services, gateway, base_url, client, stub,
    MODEL_NAME, REPO_ROOT, MESSAGES, chat_prompt_ids)


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


def test_top_p_zero_is_greedy_on_grpc_as_on_http():
    """One meaning for top_p = 0 on both APIs: greedy (OpenAI's); unset top_p is 1."""
    from services.gateway.grpc_api import GenerateServicer
    from services.gateway.openai_api import CompletionRequest, to_sampling_params
    from specd.v1 import common_pb2

    def grpc_params(**sampling):
        request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1]),
                                               sampling=common_pb2.SamplingParameters(**sampling))
        return GenerateServicer.to_sampling_params(request, 8)

    http = to_sampling_params(CompletionRequest(prompt="x", temperature=0.7, top_p=0.0), 8)
    over_grpc = grpc_params(temperature=0.7, top_p=0.0)
    assert http.is_greedy and over_grpc.is_greedy and (over_grpc.temperature, over_grpc.top_p) == (0.0, 1.0)
    unset = grpc_params(temperature=0.7)
    assert not unset.is_greedy and unset.top_p == 1.0
    assert grpc_params(temperature=0.7, top_p=0.5).top_p == 0.5
