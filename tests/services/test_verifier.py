"""The verifier service against a real Redis, its worker in-process (driven directly or in a
thread): greedy speculative output against target-only decoding, bad entries, deadlines, the
result queue's batching and its retries, the admin API. Requests are XADDed the way the gateway does.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.verifier.admin import AdminServer
from services.verifier.results.flush import ResultQueue
from services.verifier.metrics import VerifierMetrics
from services.verifier.worker import VerifierWorker, WorkerConfig
from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams
from specd.transport.redis_streams import CONSUMER_GROUP, QueuedRequest, ResultEntry, result_key
from specd.v1 import verifier_pb2, verifier_pb2_grpc
from tests.services.verifier_harness import (
    VOCAB, SESSION_LEN, ENGINE, make_requests, reference_tokens, enqueue, collect, check_answers,
    assert_queue_empty, spec_config, RunningWorker, make_worker)


# ---- in-process -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_inprocess_speculative_greedy_equals_target(redis_url, client, target, tiny_models, method):
    stream = f"inproc-{method}:requests"
    metrics = VerifierMetrics()
    running = RunningWorker(make_worker(redis_url, target, stream, spec_config(method, tiny_models),
                                        metrics=metrics))
    try:
        requests = make_requests(10, seed=1, prefix=f"ip-{method}")
        enqueue(client, stream, requests)
        results = collect(client, [r.request_id for r in requests])
    finally:
        running.stop()
    check_answers(results, reference_tokens(target, requests))
    assert_queue_empty(client, stream)
    assert all(0 < client.ttl(result_key(r.request_id)) <= 600 for r in requests)
    total = sum((results[r.request_id][-1].spec_stats.num_draft_tokens for r in requests), 0)
    assert total > 0
    exposition = metrics.registry.get_sample_value
    assert exposition("specd:spec_decode_num_draft_tokens_total") == total
    assert exposition("specd:request_success_total", {"finished_reason": "length"}) >= 1
    assert exposition("specd:step_duration_seconds_count", {"phase": "verify"}) > 0
    # "other" is split into the commit's device wait, the commit, the result writes, the admitted
    # requests' prefill and the rest
    split = sum(exposition("specd:step_duration_seconds_sum", {"phase": p})
                for p in ("device_wait", "commit", "emit", "prefill", "rest"))
    assert exposition("specd:step_duration_seconds_sum", {"phase": "emit"}) > 0
    assert exposition("specd:step_duration_seconds_sum", {"phase": "prefill"}) > 0
    # every request was prefilled by some admission forward, each counted on its path
    prefills = sum(exposition("specd:prefill_forwards_total", {"path": p}) or 0 for p in ("static", "eager"))
    assert 1 <= prefills <= len(requests)
    assert split == pytest.approx(exposition("specd:step_duration_seconds_sum", {"phase": "other"}), rel=1e-6)


def test_inprocess_bad_entries_get_errors_and_serving_goes_on(redis_url, client, target):
    stream = "inproc-bad:requests"
    running = RunningWorker(make_worker(redis_url, target, stream))
    good = make_requests(2, seed=2, prefix="bad-good")
    body = json.loads(good[0].to_fields()["body"])
    try:
        enqueue(client, stream, [
            {"id": "bad-json", "body": "{not json"},
            {"body": "{}"},  # no id: nobody to answer, just dropped
            {"id": "bad-temp", "body": json.dumps({**body, "params": {**body["params"], "temperature": -1}})},
            {"id": "bad-field", "body": json.dumps({**body, "params": {**body["params"], "nope": 1}})},
            QueuedRequest("too-long", [5] * (SESSION_LEN + 10), SamplingParams()),
            QueuedRequest("bad-token", [5, VOCAB + 7], SamplingParams()),
            QueuedRequest("late", [5, 6], SamplingParams(), deadline=time.time() - 1),
            good[0], good[1]])
        bad_ids = ["bad-json", "bad-temp", "bad-field", "too-long", "bad-token", "late"]
        results = collect(client, bad_ids + [r.request_id for r in good])
    finally:
        running.stop()
    errors = {rid: results[rid] for rid in bad_ids}
    assert all(len(e) == 1 and e[0].kind == "error" for e in errors.values()), errors
    assert {rid: e[0].code for rid, e in errors.items()} == {
        "bad-json": 400, "bad-temp": 400, "bad-field": 400, "too-long": 400, "bad-token": 400, "late": 504}
    assert "context length" in errors["too-long"][0].message and "temperature" in errors["bad-temp"][0].message
    check_answers({r.request_id: results[r.request_id] for r in good}, reference_tokens(target, good))
    assert_queue_empty(client, stream)
    assert running.worker.num_errors == 7


def test_deadline_while_running_aborts_and_frees_the_cache(redis_url, client, target):
    now = [1000.0]
    worker = make_worker(redis_url, target, "inproc-deadline:requests", clock=lambda: now[0])
    free_blocks = worker.engine.runner.kv_cache.allocator.num_free_blocks
    keep, drop = make_requests(2, seed=3, prefix="dl", max_new_tokens=(16,), ignore_eos=True)
    drop.deadline = 1005.0
    enqueue(client, "inproc-deadline:requests", [keep, drop])
    worker.run_once()
    worker.run_once()
    assert len(worker.active) == 2
    now[0] = 1006.0
    while worker.active:
        worker.run_once()
    results = collect(client, [keep.request_id, drop.request_id], timeout=5)
    check_answers({keep.request_id: results[keep.request_id]}, reference_tokens(target, [keep]))
    *deltas, error = results[drop.request_id]
    assert error.kind == "error" and error.code == 504 and "deadline" in error.message
    assert error.pos == sum(len(d.tokens) for d in deltas) > 0
    assert worker.engine.runner.kv_cache.allocator.num_free_blocks == free_blocks
    assert_queue_empty(client, "inproc-deadline:requests")


class PipelineOnlyClient:
    """Counts the Redis calls the worker makes (a pipeline is one round trip)."""

    def __init__(self, real: redis.Redis) -> None:
        self.real, self.calls = real, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.real, name)


def test_emit_is_one_round_trip_per_step_for_a_batch_of_32(redis_url, client, target):
    stream = "inproc-batch32:requests"
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=32, **ENGINE))
    spy = PipelineOnlyClient(redis.Redis.from_url(redis_url))
    worker = VerifierWorker(engine, spy, WorkerConfig(consumer="b32", request_stream=stream, log_interval_s=0))
    worker.ensure_group()
    requests = make_requests(32, seed=4, prefix="b32", max_new_tokens=(12,), ignore_eos=True, stop_token_ids=[])
    enqueue(client, stream, requests)
    worker.run_once()  # reads all 32 (one XREADGROUP), prefills, emits
    assert len(worker.active) == 32
    emit_ms = []
    while worker.active:
        spy.calls.clear()
        record = worker.run_once()
        assert spy.calls == ["pipeline"], spy.calls  # the batch is full: no read, one result pipeline
        if record.num_running == 32:
            emit_ms.append(record.emit_seconds * 1000)
    emit_ms.sort()
    print(f"\nemit per step, batch 32: p50 {emit_ms[len(emit_ms) // 2]:.3f} ms, max {emit_ms[-1]:.3f} ms "
          f"({len(emit_ms)} steps)")
    check_answers(collect(client, [r.request_id for r in requests], timeout=5), reference_tokens(target, requests))
    assert_queue_empty(client, stream)


class FailingOnceClient:
    """The first pipeline's execute fails as if Redis were unreachable; later ones go through."""

    def __init__(self, real: redis.Redis) -> None:
        self.real, self.failed = real, False

    def pipeline(self, **kw):
        pipe = self.real.pipeline(**kw)
        if not self.failed:
            self.failed = True

            def down(**_):
                pipe.reset()
                raise redis.ConnectionError("redis down (test)")
            pipe.execute = down
        return pipe


def test_the_result_queue_keeps_its_queue_when_redis_is_unreachable(client):
    result_queue = ResultQueue(FailingOnceClient(client), "result-queue-retry:requests")
    result_queue.delta("retry-a", 0, [7, 8])
    with pytest.raises(redis.ConnectionError):
        result_queue.flush()
    assert result_queue.has_pending and not client.exists(result_key("retry-a"))
    result_queue.final("retry-a", 2, [9], "length", None, prompt_tokens=3)
    assert result_queue.flush() == 2 and not result_queue.has_pending
    entries = [ResultEntry.from_fields(f) for _, f in client.xrange(result_key("retry-a"))]
    assert [(e.kind, e.pos, e.tokens) for e in entries] == [("delta", 0, [7, 8]), ("final", 2, [9])]
    assert entries[-1].finish_reason == "length" and entries[-1].prompt_tokens == 3


def test_admin_stats_health_reflection_and_drain(redis_url, client, target):
    stream = "inproc-admin:requests"
    admin = AdminServer("127.0.0.1", 0).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{admin.port}")
    stub = verifier_pb2_grpc.VerifierAdminStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            stub.Stats(verifier_pb2.VerifierStatsRequest())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        worker = make_worker(redis_url, target, stream, SpeculativeConfig(method="ngram", num_speculative_tokens=2))
        admin.attach(worker)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        running = RunningWorker(worker)
        requests = make_requests(6, seed=5, prefix="adm", max_new_tokens=(60,), ignore_eos=True)
        enqueue(client, stream, requests)
        collect(client, [r.request_id for r in requests], stop_after=lambda res: any(res.values()))
        reply = stub.Drain(verifier_pb2.DrainRequest(exit_when_drained=True))
        assert reply.num_running + reply.num_waiting > 0
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        running.thread.join(timeout=30)
        assert not running.thread.is_alive() and running.error is None
        # Those admitted before the drain (at most a batch of 4) ran to the end; the others stay
        # queued, unread, for other verifiers.
        admitted = [r for r in requests if client.exists(result_key(r.request_id))]
        assert 1 <= len(admitted) <= 4
        results = collect(client, [r.request_id for r in admitted], timeout=5)
        check_answers(results, reference_tokens(target, admitted))
        assert client.xlen(stream) == len(requests) - len(admitted)
        assert client.xpending(stream, CONSUMER_GROUP)["pending"] == 0

        stats = stub.Stats(verifier_pb2.VerifierStatsRequest())
        assert stats.consumer == "inproc" and stats.draining and stats.num_finished == len(admitted)
        assert stats.num_running == 0 and stats.num_steps > 0 and stats.num_output_tokens == sum(
            len(t) for t in reference_tokens(target, admitted).values())
        assert stats.spec_stats.num_draft_tokens > 0 and stats.verify_seconds > 0 and stats.other_seconds > 0

        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in answer.list_services_response.service}
        assert {"specd.v1.VerifierAdmin", "grpc.health.v1.Health"} <= names
    finally:
        channel.close()
        admin.stop(grace=0)
