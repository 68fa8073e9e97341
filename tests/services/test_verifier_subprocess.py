"""`python -m specd.cli verifier` as real subprocesses against a real Redis: greedy output against
target-only decoding, stop words, malformed entries, admin health and metrics, two verifiers
sharing the stream, SIGTERM finishing in-flight requests, --tp refused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from grpc_health.v1 import health_pb2

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig
from specd.sampling_params import SamplingParams
from specd.transport.redis_streams import CONSUMER_GROUP, QueuedRequest
from tests.services.verifier_harness import (ENGINE, ROOT, SUB_STREAM, VerifierProcess, assert_queue_empty,
                                             check_answers, collect, enqueue, make_requests, reference_tokens)




@pytest.fixture(scope="module")
def verifier(redis_url, target, tmp_path_factory):
    proc = VerifierProcess(redis_url, target, SUB_STREAM, "v1", tmp_path_factory.mktemp("verifier-logs"))
    try:
        yield proc.wait_serving()
    finally:
        proc.close()


def test_subprocess_greedy_equals_target(verifier, client, target):
    requests = make_requests(8, seed=6, prefix="sub")
    enqueue(client, SUB_STREAM, requests)
    check_answers(collect(client, [r.request_id for r in requests]), reference_tokens(target, requests))
    assert_queue_empty(client, SUB_STREAM)


def test_subprocess_stop_words_use_the_model_tokenizer(verifier, client, target):
    from specd.models.loader import load_tokenizer

    tokenizer = load_tokenizer(target)
    prompt = [17, 42, 99, 17, 42]
    free_run = reference_tokens(target, [QueuedRequest("sw-free", prompt, SamplingParams(max_new_tokens=24))])
    out = free_run["sw-free"]
    # A word that first shows up a few tokens into the free-running output.
    words = [(i, tokenizer.decode(out[i:i + 1]).strip()) for i in range(3, len(out) - 2)]
    words = [(i, w) for i, w in words if len(w) >= 2 and w.isprintable() and w not in tokenizer.decode(out[:i])]
    assert words, "the tiny target's output should contain a word that first appears mid-output"
    word = words[0][1]
    params = SamplingParams(max_new_tokens=24, stop_words=[word])
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=1, **ENGINE), tokenizer=tokenizer)
    expected = engine.generate([prompt], [params])[0]
    assert expected.finish_reason == "stop" and expected.num_output_tokens < 24
    enqueue(client, SUB_STREAM, [QueuedRequest("sw", prompt, params)])
    results = collect(client, ["sw"])
    check_answers(results, {"sw": expected.output_token_ids})
    assert results["sw"][-1].finish_reason == "stop"


def test_subprocess_malformed_entry_then_keeps_serving(verifier, client, target):
    good = make_requests(1, seed=7, prefix="sub-after-bad")
    enqueue(client, SUB_STREAM, [{"id": "sub-bad", "body": "[]"}, {"junk": "x"}, *good])
    results = collect(client, ["sub-bad", good[0].request_id])
    assert [(e.kind, e.code) for e in results["sub-bad"]] == [("error", 400)]
    check_answers({good[0].request_id: results[good[0].request_id]}, reference_tokens(target, good))
    assert_queue_empty(client, SUB_STREAM)
    assert verifier.proc.poll() is None


def test_subprocess_admin_health_and_metrics(verifier):
    stats = verifier.stats()
    assert stats.consumer == "v1" and stats.num_finished >= 9 and stats.num_errors >= 1
    assert stats.num_steps > 0 and stats.spec_stats.num_draft_tokens > 0 and not stats.draining
    status = verifier.health.Check(health_pb2.HealthCheckRequest(service="specd.v1.VerifierAdmin"), timeout=5)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    with urllib.request.urlopen(f"http://127.0.0.1:{verifier.metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert "specd:spec_decode_num_accepted_tokens_per_pos_total" in text
    assert 'specd:step_duration_seconds_bucket{le="0.001",phase="draft"}' in text


def test_two_verifiers_split_the_stream(verifier, client, redis_url, target, tmp_path):
    second = VerifierProcess(redis_url, target, SUB_STREAM, "v2", tmp_path)
    try:
        second.wait_serving()
        before = {v: v.stats().num_finished for v in (verifier, second)}
        requests = make_requests(16, seed=8, prefix="split", max_new_tokens=(24, 40))
        enqueue(client, SUB_STREAM, requests)
        check_answers(collect(client, [r.request_id for r in requests]), reference_tokens(target, requests))
        served = {v.stats().consumer: v.stats().num_finished - before[v] for v in (verifier, second)}
        assert sum(served.values()) == 16 and min(served.values()) > 0, served
        assert_queue_empty(client, SUB_STREAM)
        assert second.terminate() == 0, second.log()
    finally:
        second.close()


def test_sigterm_finishes_in_flight_requests_then_exits_0(client, redis_url, target, tmp_path):
    stream = "sigterm:requests"
    proc = VerifierProcess(redis_url, target, stream, "v3", tmp_path)
    try:
        proc.wait_serving()
        requests = make_requests(4, seed=9, prefix="term", max_new_tokens=(96,), ignore_eos=True,
                                 stop_token_ids=[])
        enqueue(client, stream, requests)
        ids = [r.request_id for r in requests]
        early = collect(client, ids, stop_after=lambda res: all(res.values()))
        proc.proc.send_signal(signal.SIGTERM)
        late = QueuedRequest("term-late", [5, 6, 7], SamplingParams(max_new_tokens=4))
        time.sleep(0.3)  # the drain has begun: this one must stay queued for another verifier
        enqueue(client, stream, [late])
        assert proc.proc.wait(timeout=60) == 0, proc.log()
        assert not any(e.kind == "final" for res in early.values() for e in res), "finished before SIGTERM"
        results = collect(client, ids, timeout=5)
        check_answers(results, reference_tokens(target, requests))
        assert client.xlen(stream) == 1 and client.xpending(stream, CONSUMER_GROUP)["pending"] == 0
        assert "draining" in proc.log()
    finally:
        proc.close()


def test_tp_above_1_is_refused(redis_url, target):
    done = subprocess.run([sys.executable, "-m", "specd.cli", "verifier", str(target), "--redis-url", redis_url,
                           "--tp", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode != 0
    assert "--tp 2" in done.stderr and "tensor parallelism" in done.stderr


@pytest.mark.parametrize("flag", ["--admin-port", "--metrics-port"])
def test_a_busy_port_is_a_clear_error(redis_url, target, flag):
    """A second verifier on one host (the admin port is 50071 by default): one line naming the
    flag and what to do, exit 2, no traceback."""
    import socket

    from specd.transport.ports import free_port

    with socket.socket() as held:
        held.bind(("0.0.0.0", free_port()))
        held.listen()
        busy = held.getsockname()[1]
        ports = {"--admin-port": str(busy) if flag == "--admin-port" else "0",
                 "--metrics-port": str(busy) if flag == "--metrics-port" else "0"}
        done = subprocess.run([sys.executable, "-m", "specd.cli", "verifier", str(target), "--redis-url", redis_url,
                               *[x for kv in ports.items() for x in kv]], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr
    assert f"{flag} {busy}: cannot bind" in done.stderr and "Traceback" not in done.stderr, done.stderr
