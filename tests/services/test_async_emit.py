"""The result writer thread (services/verifier/results/writer.py) against a real Redis: a step's results go
out while the next step runs, yet strictly in order (deltas by position, a request's XACK + XDEL
after its final); a failed flush is sent again in order; cancellation, drain and stop still write
everything; and the loop really overlaps the round trip with the engine step. Redis is slowed
down, made to fail, and logged by a client wrapper; each loop-level test runs with the writer on
and off (async_emit)."""

from __future__ import annotations

import time

import pytest
import redis

from services.verifier.results.flush import ResultQueue
from specd import settings

EARLY_FIRST_TOKEN_ENV = settings.VERIFIER_EARLY_FIRST_TOKEN.name
from services.verifier.results.writer import ResultWriter
from specd.sampling_params import SamplingParams
from specd.transport.redis_streams import CONSUMER_GROUP, QueuedRequest, ResultEntry, cancel_key, result_key
from tests.services.emit_helpers import SlowRedis, check_write_order, enqueue, make_worker, read_streams, \
    run_until_idle
from tests.services.fault_helpers import delivered_tokens, read_like_the_gateway
from tests.services.verifier_harness import RunningWorker, assert_queue_empty, check_answers, make_requests, \
    reference_tokens

WRITER_THREAD = "specd-result-writer"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the writer alone ---------------------------------------------------------------------------
def test_writer_keeps_a_failed_flush_in_front_of_the_next(client):
    slow = SlowRedis(client, fail=lambda n: "before" if n == 0 else None)
    result_queue = ResultQueue(slow, "writer-unit:requests")
    writer = ResultWriter(result_queue)
    result_queue.delta("wu-a", 0, [1, 2])
    assert writer.start() and writer.in_flight and writer.has_pending
    with pytest.raises(RuntimeError):
        writer.start()  # one flush in flight at a time
    result_queue.delta("wu-a", 2, [3])  # queued while the first is on its way
    with pytest.raises(redis.ConnectionError):
        writer.wait()
    assert not writer.in_flight and result_queue.has_pending and not client.exists(result_key("wu-a"))
    result_queue.final("wu-a", 3, [4], "length", None, prompt_tokens=1)
    assert writer.start()
    flush = writer.wait()
    assert flush.seconds > 0 and not writer.has_pending
    got = [(e.kind, e.pos, e.tokens) for e in read_streams(client, ["wu-a"])["wu-a"]]
    assert got == [("delta", 0, [1, 2]), ("delta", 2, [3]), ("final", 3, [4])]
    assert slow.executed[-1].thread.startswith(WRITER_THREAD)
    assert writer.wait() is None and writer.flush() is None  # nothing in flight, nothing queued
    writer.close()


# ---- ordering ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_emit", [True, False])
def test_deltas_and_finals_in_order_across_many_steps(redis_url, client, target, async_emit):
    stream = f"async-order-{async_emit}:requests"
    worker, slow = make_worker(redis_url, target, stream, async_emit, delay_s=0.003)
    requests = make_requests(12, seed=31, prefix=f"ao-{async_emit}", max_new_tokens=(20, 45, 70))
    entries = enqueue(client, stream, requests)
    records = run_until_idle(worker)
    assert len(records) > 20
    ids = [r.request_id for r in requests]
    check_answers(read_streams(client, ids), reference_tokens(target, requests))  # written already
    check_write_order(slow.executed, entries)
    assert_queue_empty(client, stream, timeout=0)
    threads = {ex.thread.startswith(WRITER_THREAD) for ex in slow.executed}
    assert threads == ({True, False} if async_emit else {False})  # the last flush: nothing to overlap
    assert slow.max_concurrent == 1


# ---- failures ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["before", "after"])
def test_a_failed_flush_is_sent_again_in_order(redis_url, client, target, mode, caplog):
    stream = f"async-fail-{mode}:requests"
    failing = {3, 4, 9}
    worker, slow = make_worker(redis_url, target, stream, fail=lambda n: mode if n in failing else None)
    requests = make_requests(6, seed=32, prefix=f"af-{mode}", max_new_tokens=(30, 50))
    entries = enqueue(client, stream, requests)
    run_until_idle(worker)
    ids = [r.request_id for r in requests]
    want = reference_tokens(target, requests)
    if mode == "before":  # nothing of a failed pipeline ran: the streams are exact
        check_answers(read_streams(client, ids), want)
        check_write_order(slow.executed, entries)
    else:  # a lost reply: the pipeline is written twice; readers drop the repeated positions
        got = read_like_the_gateway(redis_url, ids, timeout=10)
        for rid in ids:
            assert got[rid][-1].kind == "final" and delivered_tokens(got[rid]) == want[rid], rid
    assert "redis unavailable" in caplog.text
    assert not worker.writer.has_pending and worker.redis_health.failures == 0
    assert_queue_empty(client, stream, timeout=0)


def test_an_exception_of_the_writer_thread_reaches_the_loop(redis_url, client, target):
    stream = "async-bug:requests"
    worker, _ = make_worker(redis_url, target, stream, fail=lambda n: "bug" if n == 1 else None)
    enqueue(client, stream, make_requests(2, seed=33, prefix="ab", max_new_tokens=(40,), ignore_eos=True))
    worker.run_once()  # flush 0: the first tokens (worker.emit_first_tokens); flush 1, the step's, fails
    with pytest.raises(RuntimeError, match="a bug in the writer"):
        worker.run_once()  # raised on the loop's thread, where it waits for that flush
    assert worker.result_queue.has_pending and not worker.writer.in_flight  # its results kept for the next flush


# ---- cancellation, drain, stop -----------------------------------------------------------------------
@pytest.mark.parametrize("async_emit", [True, False])
def test_a_request_cancelled_as_it_finishes_is_cancelled(redis_url, client, target, async_emit):
    stream = f"async-cancel-{async_emit}:requests"
    # Speculation off: step 1 prefills (1 token) and queues a decode step that lands in step 2
    # (specd/engine/overlap.py), then 1 token a step.
    worker, _ = make_worker(redis_url, target, stream, async_emit, spec=None)
    free_blocks = worker.engine.runner.kv_cache.allocator.num_free_blocks
    rid = f"ac-{async_emit}"
    client.set(cancel_key(rid), 1, ex=60)
    enqueue(client, stream, [QueuedRequest(rid, [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))])
    # Async: step 1's poll sees the key, but its answer arrives after step 2, which finished the
    # request; the cancellation still wins (no final), as it does when applied at once.
    for _ in range(3):
        worker.run_once()
    assert worker.num_cancelled == 1 and worker.num_finished == 0 and not worker.active
    assert worker.engine.stats.num_output_tokens == (2 if async_emit else 1)  # one step late when async
    assert not client.exists(result_key(rid))
    assert worker.engine.runner.kv_cache.allocator.num_free_blocks == free_blocks
    assert_queue_empty(client, stream, timeout=0)


@pytest.mark.parametrize("async_emit", [True, False])
def test_drain_writes_everything_before_the_worker_is_done(redis_url, client, target, async_emit):
    stream = f"async-drain-{async_emit}:requests"
    worker, slow = make_worker(redis_url, target, stream, async_emit, max_batch_size=4, delay_s=0.02)
    requests = make_requests(6, seed=34, prefix=f"ad-{async_emit}", max_new_tokens=(40,), ignore_eos=True)
    entries = enqueue(client, stream, requests)
    running = RunningWorker(worker)
    deadline = time.monotonic() + 30
    while worker.engine.stats.num_steps < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker.drain(exit_when_drained=True)
    running.thread.join(timeout=60)
    assert not running.thread.is_alive() and running.error is None
    # Right as the loop returns (no waiting here): every admitted request is answered and acknowledged.
    admitted = [r for r in requests if client.exists(result_key(r.request_id))]
    assert len(admitted) == 4 and not worker.writer.has_pending
    check_answers(read_streams(client, [r.request_id for r in admitted]), reference_tokens(target, admitted))
    assert client.xlen(stream) == 2 and client.xpending(stream, CONSUMER_GROUP)["pending"] == 0
    check_write_order(slow.executed, entries)


def test_stop_lands_the_flush_in_flight(redis_url, client, target):
    stream = "async-stop:requests"
    worker, slow = make_worker(redis_url, target, stream, delay_s=0.2)
    requests = make_requests(3, seed=35, prefix="as", max_new_tokens=(60,), ignore_eos=True)
    enqueue(client, stream, requests)
    running = RunningWorker(worker)
    deadline = time.monotonic() + 30
    while not worker.writer.in_flight or worker.engine.stats.num_steps < 3:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    running.stop()  # returns once run() did: the 0.2 s flush in flight has landed by then
    assert not worker.writer.in_flight and slow.executed
    written = read_streams(client, [r.request_id for r in requests])
    for r in requests:
        ar = next(a for a in worker.active.values() if a.request_id == r.request_id)
        assert sum(len(e.tokens) for e in written[r.request_id]) == ar.num_emitted, r.request_id


@pytest.mark.parametrize("async_emit", [True, False])
def test_a_reclaim_scan_leaves_alone_what_the_flush_in_flight_acknowledges(redis_url, client, target,
                                                                           async_emit):
    # Steps longer than the idle limit: each scan (in admit) finds this verifier's own entries idle,
    # among them the one whose final and XACK the writer is still sending.
    stream = f"async-scan-{async_emit}:requests"
    worker, _ = make_worker(redis_url, target, stream, async_emit, spec=None, idle_ms=100, delay_s=0.05)
    engine_step = worker.engine.step

    def slow_step():
        time.sleep(0.15)
        return engine_step()

    worker.engine.step = slow_step
    short = QueuedRequest(f"sc-short-{async_emit}", [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
    long = QueuedRequest(f"sc-long-{async_emit}", [8, 9], SamplingParams(max_new_tokens=8, ignore_eos=True))
    enqueue(client, stream, [short, long])
    run_until_idle(worker)
    assert worker.num_reclaimed == 0 and worker.num_finished == 2
    check_answers(read_streams(client, [short.request_id, long.request_id]),
                  reference_tokens(target, [short, long]))
    assert_queue_empty(client, stream, timeout=0)


# ---- overlap ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_emit", [True, False])
def test_the_engine_step_overlaps_the_previous_flush(redis_url, client, target, async_emit):
    stream = f"async-overlap-{async_emit}:requests"
    worker, slow = make_worker(redis_url, target, stream, async_emit, delay_s=0.04)
    steps: list[tuple[float, float]] = []
    engine_step = worker.engine.step

    def slow_step():  # as long as the round trip: a synchronous loop takes twice as long
        t0 = time.perf_counter()
        time.sleep(0.04)
        try:
            return engine_step()
        finally:
            steps.append((t0, time.perf_counter()))

    worker.engine.step = slow_step
    requests = make_requests(2, seed=36, prefix=f"ov-{async_emit}", max_new_tokens=(12,), ignore_eos=True,
                             stop_token_ids=[])
    enqueue(client, stream, requests)
    t0 = time.perf_counter()
    records = run_until_idle(worker)
    elapsed = time.perf_counter() - t0
    flushes = [(ex.start, ex.end) for ex in slow.executed]
    overlapped = sum(any(fs < se and ss < fe for fs, fe in flushes) for ss, se in steps)
    wait = sum(r.emit_wait_seconds for r in records)
    flush = sum(r.flush_seconds for r in records)
    serial = sum(e - s for s, e in steps) + sum(e - s for s, e in flushes)  # the loop without overlap
    print(f"\nasync_emit={async_emit}: {len(steps)} steps in {elapsed:.2f} s ({serial:.2f} s of steps and "
          f"round trips), {overlapped} overlapped a flush; the loop waited {wait:.2f} s of {flush:.2f} s")
    if async_emit:
        assert overlapped >= len(steps) - 1  # all but the first: no flush before it
        assert wait < 0.5 * flush
        assert elapsed < 0.8 * serial
    else:
        assert overlapped == 0 and wait >= flush and elapsed >= serial
    check_answers(read_streams(client, [r.request_id for r in requests]), reference_tokens(target, requests))


# ---- the first token ---------------------------------------------------------------------------------
@pytest.mark.parametrize("async_emit,early", [(True, True), (True, False), (False, True)])
def test_the_first_token_is_written_before_the_first_draft(redis_url, client, target, async_emit, early,
                                                           monkeypatch):
    """With the writer (async_emit), the first token (the prefill's) goes out on a flush of its own
    before the step drafts and verifies (worker.emit_first_tokens): the request's first draft call
    already finds it in Redis. Without the writer, or with SPECD_VERIFIER_EARLY_FIRST_TOKEN=0, it
    leaves with the step's results. The output is the target's own either way."""
    if not early:
        monkeypatch.setenv(EARLY_FIRST_TOKEN_ENV, "0")
    early = early and async_emit
    stream = f"async-first-{async_emit}-{early}:requests"
    worker, slow = make_worker(redis_url, target, stream, async_emit)
    requests = make_requests(1, seed=41, prefix=f"first-{async_emit}-{early}", max_new_tokens=(12,), ignore_eos=True)
    rid = requests[0].request_id
    at_first_draft: list[list[ResultEntry]] = []
    draft = worker.engine.draft

    def drafting(batch, prefetched=None):
        if not at_first_draft:  # the request's first step: wait a little for the writer thread's flush
            deadline = time.monotonic() + (2.0 if early else 0.3)
            while not client.xrange(result_key(rid)) and time.monotonic() < deadline:
                time.sleep(0.005)
            at_first_draft.append(read_streams(client, [rid])[rid])
        return draft(batch, prefetched)

    worker.engine.draft = drafting
    entries = enqueue(client, stream, requests)
    run_until_idle(worker)
    first = at_first_draft[0]
    if early:
        assert [(e.kind, e.pos, len(e.tokens)) for e in first] == [("delta", 0, 1)], first
    else:
        assert first == []
    check_answers(read_streams(client, [rid]), reference_tokens(target, requests))
    check_write_order(slow.executed, entries)
