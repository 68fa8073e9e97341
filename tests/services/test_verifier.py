"""The verifier service against a real Redis: the worker in-process (driven directly or in a thread)
and `python -m specd.cli verifier` as real subprocesses. Requests are XADDed the way the gateway
does; answers are read back from the result streams and compared with target-only greedy decoding.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.verifier.admin import AdminServer
from services.verifier.emitter import ResultEmitter
from services.verifier.metrics import VerifierMetrics
from services.verifier.worker import VerifierWorker, WorkerConfig
from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams
from specd.transport.embedded_redis import free_port
from specd.transport.redis_streams import CONSUMER_GROUP, QueuedRequest, ResultEntry, result_key
from specd.v1 import verifier_pb2, verifier_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512
SESSION_LEN = 256
ENGINE = dict(block_size=8, session_len=SESSION_LEN)


# ---- helpers ------------------------------------------------------------------------------------
def make_requests(n: int, seed: int, prefix: str, max_new_tokens=(5, 11, 24), **param_overrides) -> list[QueuedRequest]:
    """Mixed prompt lengths (some repetitive, for n-gram matches), limits and stop tokens; greedy."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        length = rng.choice([1, 3, 7, 12, 20])
        prompt = [rng.randrange(4, VOCAB) for _ in range(length)]
        if i % 3 == 0:
            prompt = prompt * 3
        params = dict(temperature=0.0, max_new_tokens=rng.choice(max_new_tokens),
                      stop_token_ids=[rng.randrange(4, VOCAB) for _ in range(3)] if i % 2 else [],
                      ignore_eos=i % 4 == 1)
        params.update(param_overrides)
        requests.append(QueuedRequest(f"{prefix}-{i}", prompt, SamplingParams(**params)))
    return requests


_references: dict[tuple, list[int]] = {}


def reference_tokens(target: Path, requests: list[QueuedRequest]) -> dict[str, list[int]]:
    """Target-only greedy decoding in-process: what every verifier must emit token for token."""
    todo = [r for r in requests if (tuple(r.prompt_token_ids), repr(r.params)) not in _references]
    if todo:
        engine = build_engine(target, PytorchEngineConfig(max_batch_size=len(todo), **ENGINE))
        for r, seq in zip(todo, engine.generate([r.prompt_token_ids for r in todo], [r.params for r in todo])):
            _references[(tuple(r.prompt_token_ids), repr(r.params))] = seq.output_token_ids
    return {r.request_id: _references[(tuple(r.prompt_token_ids), repr(r.params))] for r in requests}


def enqueue(client: redis.Redis, stream: str, requests: list[QueuedRequest | dict]) -> None:
    pipe = client.pipeline(transaction=False)
    for r in requests:
        pipe.xadd(stream, r.to_fields() if isinstance(r, QueuedRequest) else r)
    pipe.execute()


def collect(client: redis.Redis, request_ids: list[str], timeout: float = 60.0,
            stop_after=None) -> dict[str, list[ResultEntry]]:
    """Read result streams until each request has its final or error entry."""
    results = {rid: [] for rid in request_ids}
    last = {result_key(rid): "0" for rid in request_ids}
    deadline = time.monotonic() + timeout
    while last:
        if time.monotonic() > deadline:
            raise AssertionError(f"no final for {sorted(k.rsplit(':', 1)[-1] for k in last)}")
        for key, entries in client.xread(last, block=200) or []:
            key = key.decode()
            for entry_id, fields in entries:
                last[key] = entry_id
                entry = ResultEntry.from_fields(fields)
                results[key[len("specd:results:"):]].append(entry)
                if entry.kind in ("final", "error"):
                    del last[key]
        if stop_after is not None and stop_after(results):
            break
    return results


def check_answers(results: dict[str, list[ResultEntry]], expected: dict[str, list[int]]) -> None:
    """Contiguous positions, exactly one final (the last entry), tokens equal to the reference."""
    for rid, entries in results.items():
        kinds = [e.kind for e in entries]
        assert kinds.count("final") == 1 and kinds[-1] == "final", (rid, kinds)
        assert set(kinds[:-1]) <= {"delta"}, (rid, kinds)
        tokens: list[int] = []
        for e in entries:
            assert e.pos == len(tokens), (rid, [(x.pos, len(x.tokens)) for x in entries])
            tokens += e.tokens
        assert tokens == expected[rid], rid
        final = entries[-1]
        assert final.finish_reason in ("stop", "length") and final.prompt_tokens > 0


def assert_queue_empty(client: redis.Redis, stream: str, timeout: float = 2.0) -> None:
    """Every answered entry was XACKed and XDELed: XLEN and the group's pending count back to 0."""
    deadline = time.monotonic() + timeout
    while True:
        length, pending = client.xlen(stream), client.xpending(stream, CONSUMER_GROUP)["pending"]
        if (length, pending) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert (length, pending) == (0, 0)


def spec_config(method: str, tiny_models) -> SpeculativeConfig:
    model = str(tiny_models["draft-llama-small"]) if method == "draft_model" else ""
    return SpeculativeConfig(method=method, num_speculative_tokens=3, model=model)


class RunningWorker:
    """A VerifierWorker looping in a thread (the in-process service)."""

    def __init__(self, worker: VerifierWorker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as e:  # surfaced by stop()
            self.error = e

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive() and self.error is None, self.error


def make_worker(redis_url: str, target: Path, stream: str, spec=None, max_batch_size: int = 4,
                **worker_kw) -> VerifierWorker:
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=max_batch_size, **ENGINE), spec)
    worker = VerifierWorker(engine, redis.Redis.from_url(redis_url),
                            WorkerConfig(consumer="inproc", request_stream=stream, log_interval_s=0),
                            **worker_kw)
    worker.ensure_group()
    return worker


pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    # "other" is split into the commit's device wait, the commit, the result writes and the rest
    split = sum(exposition("specd:step_duration_seconds_sum", {"phase": p})
                for p in ("device_wait", "commit", "emit", "rest"))
    assert exposition("specd:step_duration_seconds_sum", {"phase": "emit"}) > 0
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


def test_emitter_keeps_its_queue_when_redis_is_unreachable(client):
    emitter = ResultEmitter(FailingOnceClient(client), "emitter-retry:requests")
    emitter.delta("retry-a", 0, [7, 8])
    with pytest.raises(redis.ConnectionError):
        emitter.flush()
    assert emitter.has_pending and not client.exists(result_key("retry-a"))
    emitter.final("retry-a", 2, [9], "length", None, prompt_tokens=3)
    assert emitter.flush() == 2 and not emitter.has_pending
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


# ---- subprocesses ---------------------------------------------------------------------------------
class VerifierProcess:
    """`python -m specd.cli verifier ...` with its admin port; logs go to a file."""

    def __init__(self, redis_url: str, target: Path, stream: str, consumer: str, log_dir: Path, *extra: str) -> None:
        self.admin_port, self.metrics_port = free_port(), free_port()
        self.log_path = log_dir / f"{consumer}.log"
        args = [sys.executable, "-m", "specd.cli", "verifier", str(target), "--redis-url", redis_url,
                "--request-stream", stream, "--consumer", consumer, "--max-batch-size", "4",
                "--session-len", str(SESSION_LEN), "--block-size", "8", "--device", "cpu",
                "--admin-host", "127.0.0.1", "--admin-port", str(self.admin_port),
                "--metrics-port", str(self.metrics_port), "--speculative-algorithm", "ngram",
                "--speculative-num-draft-tokens", "3", *extra]
        self.log_file = open(self.log_path, "w")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.admin_port}")
        self.admin = verifier_pb2_grpc.VerifierAdminStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def wait_serving(self, timeout: float = 90.0) -> "VerifierProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"verifier exited {self.proc.returncode}:\n{self.log()}"
            try:
                if self.health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"verifier not serving after {timeout} s:\n{self.log()}")

    def stats(self) -> verifier_pb2.VerifierStatsResponse:
        return self.admin.Stats(verifier_pb2.VerifierStatsRequest(), timeout=5)

    def log(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text()

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.channel.close()
        self.log_file.close()


SUB_STREAM = "sub:requests"


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
