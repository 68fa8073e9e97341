"""The verifier reads the request stream ahead while the engine steps (services/verifier/read_ahead.py):
a busy loop admits without a Redis round trip of its own, a request arriving mid-run is still
admitted within a step or two, and a drain serves what a read ahead had already claimed."""

from __future__ import annotations

import pytest

from services.verifier.read_ahead import ReadAhead


def test_read_ahead_returns_the_reply_once_and_reraises():
    ahead = ReadAhead()
    assert ahead.take() is None and not ahead.in_flight
    ahead.start(lambda: [("s", [("1-0", {"a": 1})])])
    assert ahead.in_flight
    assert ahead.take() == [("s", [("1-0", {"a": 1})])]
    assert ahead.take() is None

    def broken():
        raise ConnectionError("redis went away")

    ahead.start(broken)
    with pytest.raises(ConnectionError):
        ahead.take()
    assert not ahead.in_flight
    ahead.close()


import threading  # noqa: E402  (the worker tests below)
import time  # noqa: E402

import redis  # noqa: E402

from services.verifier.claims import ClaimConfig  # noqa: E402
from services.verifier.worker import VerifierWorker, WorkerConfig  # noqa: E402
from specd.engine.builder import build_engine  # noqa: E402
from specd.messages import PytorchEngineConfig  # noqa: E402
from specd.sampling_params import SamplingParams  # noqa: E402
from specd.transport.redis_streams import QueuedRequest, ResultEntry, result_key  # noqa: E402
from tests.services.fault_helpers import ENGINE  # noqa: E402

READ_AHEAD_THREAD = "specd-read-ahead"


class ReadsRecorded(redis.Redis):
    """A client that records which thread made each XREADGROUP, and can hold the read ahead's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.readers: list[str] = []
        self.hold_read_ahead = threading.Event()
        self.hold_read_ahead.set()

    def xreadgroup(self, *args, **kwargs):
        name = threading.current_thread().name
        self.readers.append(name)
        if name.startswith(READ_AHEAD_THREAD):
            assert self.hold_read_ahead.wait(30)
        return super().xreadgroup(*args, **kwargs)


def make_worker(redis_url, target, stream, read_ahead: bool, max_batch_size: int = 4):
    client = ReadsRecorded.from_url(redis_url)
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=max_batch_size, **ENGINE))
    worker = VerifierWorker(engine, client, WorkerConfig(consumer="w", request_stream=stream, log_interval_s=0,
                                                         read_ahead=read_ahead, claims=ClaimConfig(idle_ms=30_000)))
    worker.ensure_group()
    return worker, client


def request(rid: str, tokens: int) -> QueuedRequest:
    return QueuedRequest(rid, [5, 6, 7, 8], SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True))


def final_of(client, rid: str) -> ResultEntry | None:
    entries = [ResultEntry.from_fields(f) for _, f in client.xrange(result_key(rid))]
    return next((e for e in entries if e.kind in ("final", "error")), None)


@pytest.mark.parametrize("read_ahead", [True, False])
def test_a_busy_loop_reads_ahead_and_admits_a_late_request_within_two_steps(redis_url, client, target, read_ahead):
    stream = f"read-ahead-{read_ahead}:requests"
    worker, recorded = make_worker(redis_url, target, stream, read_ahead)
    try:
        client.xadd(stream, request(f"long-{read_ahead}", 40).to_fields())
        worker.run_once()  # idle: the loop's own blocking read admits it
        assert len(worker.active) == 1
        worker.run_once()
        recorded.readers.clear()
        client.xadd(stream, request(f"late-{read_ahead}", 4).to_fields())
        for iterations in range(1, 4):
            worker.run_once()
            if len(worker.active) == 2:
                break
        assert len(worker.active) == 2, "the late request was not admitted within three steps"
        busy_reads = list(recorded.readers)
        while worker.active or worker.writer.has_pending:
            worker.run_once()
    finally:
        worker.finish_writes()
    loop_reads = [r for r in busy_reads if not r.startswith(READ_AHEAD_THREAD)]
    if read_ahead:  # every read while the engine ran left the loop's thread
        assert busy_reads and not loop_reads, busy_reads
        assert iterations <= 2
    else:
        assert busy_reads and len(loop_reads) == len(busy_reads)
    assert final_of(client, f"long-{read_ahead}").kind == "final"
    assert final_of(client, f"late-{read_ahead}").kind == "final"


def test_a_drain_serves_what_the_read_ahead_claimed(redis_url, client, target):
    stream = "read-ahead-drain:requests"
    worker, recorded = make_worker(redis_url, target, stream, read_ahead=True)
    try:
        client.xadd(stream, request("first", 12).to_fields())
        recorded.hold_read_ahead.clear()  # the read ahead waits until the second request is there
        worker.run_once()
        assert worker.read_ahead.in_flight
        client.xadd(stream, request("second", 3).to_fields())
        worker.drain(exit_when_drained=True)
        recorded.hold_read_ahead.set()
        deadline = time.monotonic() + 60
        while not worker.is_done():
            assert time.monotonic() < deadline, "the drain did not finish"
            worker.run_once()
    finally:
        worker.finish_writes()
    assert final_of(client, "first").kind == "final"
    second = final_of(client, "second")  # claimed by the read ahead before the drain: served here
    assert second is not None and second.kind == "final"
    assert client.xpending(stream, worker.config.group)["pending"] == 0
