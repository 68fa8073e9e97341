"""The verifier tests' helpers: requests made the way the gateway makes them, target-only greedy
references, enqueueing and collecting through a real Redis, and an in-process worker in a thread
and a `python -m specd.cli verifier` subprocess (VerifierProcess); the verifier suites share them.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.verifier.worker import VerifierWorker, WorkerConfig
from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams
from specd.transport.ports import free_port
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


# ---- a verifier subprocess --------------------------------------------------------------------------
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
