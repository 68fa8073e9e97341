"""A slowed, failing and logging Redis client for the result writer's tests (test_async_emit.py),
and the checks those tests read Redis with."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import redis

from services.verifier.claims import ClaimConfig
from services.verifier.worker import VerifierWorker, WorkerConfig
from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.transport.redis_streams import ResultEntry, result_key
from tests.services.fault_helpers import ENGINE

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3)


@dataclass
class Executed:
    """One pipeline as it reached Redis."""

    start: float  # perf_counter
    end: float
    thread: str
    commands: list[tuple]  # the command arguments, in pipeline order


class SlowRedis:
    """A redis.Redis whose pipelines take `delay_s` longer and are logged in execution order;
    `fail(n)` for the n-th pipeline (from 0) may say "before" (Redis unreachable: nothing runs),
    "after" (it ran but the reply was lost) or "bug" (a RuntimeError, not a Redis error)."""

    def __init__(self, real: redis.Redis, delay_s: float = 0.0, fail=lambda n: None) -> None:
        self.real, self.delay_s, self.fail = real, delay_s, fail
        self.executed: list[Executed] = []
        self._count = 0
        self._lock = threading.Lock()
        self._running = 0
        self.max_concurrent = 0  # pipelines in flight at once, at most

    def __getattr__(self, name):
        return getattr(self.real, name)

    def pipeline(self, **kw):
        pipe = self.real.pipeline(**kw)
        execute = pipe.execute

        def slow_execute(**kw):
            with self._lock:
                n, self._count = self._count, self._count + 1
                self._running += 1
                self.max_concurrent = max(self.max_concurrent, self._running)
            commands = [args for args, _ in pipe.command_stack]
            start = time.perf_counter()
            try:
                time.sleep(self.delay_s)
                mode = self.fail(n)
                if mode == "before":
                    pipe.reset()
                    raise redis.ConnectionError("redis unreachable (test)")
                if mode == "bug":
                    pipe.reset()
                    raise RuntimeError("a bug in the writer (test)")
                replies = execute(**kw)
                if mode == "after":
                    raise redis.ConnectionError("reply lost (test)")
                self.executed.append(Executed(start, time.perf_counter(), threading.current_thread().name,
                                              commands))
                return replies
            finally:
                with self._lock:
                    self._running -= 1

        pipe.execute = slow_execute
        return pipe


def make_worker(redis_url, target, stream, async_emit=True, spec=NGRAM, max_batch_size=8, idle_ms=30_000,
                **slow_kw):
    slow = SlowRedis(redis.Redis.from_url(redis_url), **slow_kw)
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=max_batch_size, **ENGINE), spec)
    worker = VerifierWorker(engine, slow, WorkerConfig(consumer="w", request_stream=stream, log_interval_s=0,
                                                       async_emit=async_emit, claims=ClaimConfig(idle_ms=idle_ms)))
    worker.ensure_group()
    return worker, slow


def enqueue(client, stream, requests) -> dict[str, str]:
    """XADD the requests; returns {entry id: request id}."""
    return {client.xadd(stream, r.to_fields()).decode(): r.request_id for r in requests}


def run_until_idle(worker, timeout=60.0) -> list:
    records = [worker.run_once()]
    deadline = time.monotonic() + timeout
    while worker.active or worker.writer.has_pending:
        assert time.monotonic() < deadline, "timed out"
        records.append(worker.run_once())
    return records


def read_streams(client, ids) -> dict[str, list[ResultEntry]]:
    """The raw result streams, right now (no waiting)."""
    return {rid: [ResultEntry.from_fields(f) for _, f in client.xrange(result_key(rid))] for rid in ids}


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def check_write_order(executed: list[Executed], entries: dict[str, str]) -> None:
    """Pipelines never overlap; per request, positions never go back; a request's entry is XACKed
    and XDELed only after its final was written (earlier in the same pipeline, or before)."""
    finals: set[str] = set()
    last_pos: dict[str, int] = {}
    for earlier, later in zip(executed, executed[1:]):
        assert earlier.end <= later.start, "two flushes were in flight at once"
    for ex in executed:
        for args in ex.commands:
            name = args[0].upper()
            if name == "XADD":
                fields = {_text(k): _text(v) for k, v in zip(args[3::2], args[4::2])}  # the result queue sends bytes
                rid = args[1][len("specd:results:"):]
                assert int(fields["pos"]) >= last_pos.get(rid, 0), (rid, fields["pos"], last_pos.get(rid))
                last_pos[rid] = int(fields["pos"])
                if fields["kind"] == "final":
                    finals.add(rid)
            elif name in ("XACK", "XDEL"):
                ids = args[3:] if name == "XACK" else args[2:]
                for entry_id in ids:
                    entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    assert entries[entry_id] in finals, f"{name} of {entries[entry_id]} before its final"
