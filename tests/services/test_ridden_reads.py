"""The busy verifier's request read riding the result round trip (services/verifier/admission.py
ReadRider), against a real Redis: requests that arrive while the engine runs are admitted one
step later, without a round trip of the loop's own (but for the read after one that found
requests: a burst is read at once), and answered exactly; a ridden read whose
reply is lost loses no request (the loop reads its own pending entries back)."""

from __future__ import annotations

import time

import pytest

from services.verifier.claims import ClaimConfig
from services.verifier.worker import VerifierWorker, WorkerConfig
from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig
from tests.services.fault_helpers import ENGINE, delivered_tokens, read_like_the_gateway
from tests.services.emit_helpers import NGRAM, SlowRedis, enqueue, read_streams, run_until_idle
from tests.services.verifier_harness import assert_queue_empty, check_answers, make_requests, reference_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_worker(redis_url, target, stream, ride_reads, fail=lambda n: None):
    import redis

    slow = SlowRedis(redis.Redis.from_url(redis_url), fail=fail)
    own_reads = []
    real_read = slow.real.xreadgroup

    def counting_read(*args, **kwargs):  # the loop's own XREADGROUP round trips (not the pipeline's)
        own_reads.append(time.perf_counter())
        return real_read(*args, **kwargs)

    slow.xreadgroup = counting_read
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=8, **ENGINE), NGRAM)
    worker = VerifierWorker(engine, slow, WorkerConfig(consumer="w", request_stream=stream, log_interval_s=0,
                                                       ride_reads=ride_reads, claims=ClaimConfig(idle_ms=30_000)))
    worker.ensure_group()
    return worker, slow, own_reads


def pipelined_reads(slow) -> int:
    return sum(args[0].upper() == "XREADGROUP" for ex in slow.executed for args in ex.commands)


@pytest.mark.parametrize("ride_reads", [True, False])
def test_requests_arriving_mid_run_are_admitted_from_the_result_round_trip(redis_url, client, target, ride_reads):
    stream = f"ride-{ride_reads}:requests"
    worker, slow, own_reads = make_worker(redis_url, target, stream, ride_reads)
    first = make_requests(1, seed=41, prefix=f"rf-{ride_reads}", max_new_tokens=(60,), ignore_eos=True)
    later = make_requests(2, seed=42, prefix=f"rl-{ride_reads}", max_new_tokens=(20, 30))
    enqueue(client, stream, first)
    worker.run_once()  # idle: its own (blocking) read admits the first request
    worker.run_once()
    reads_before = len(own_reads)
    with client.pipeline(transaction=True) as pipe:  # both at once: one read finds both
        for r in later:
            pipe.xadd(stream, r.to_fields())
        pipe.execute()
    steps = 0
    while not all(any(ar.request_id == r.request_id for ar in worker.active.values()) for r in later):
        worker.run_once()
        steps += 1
        assert steps <= 3, "the later requests were not admitted"
    # ridden: a read rides each step's flush, collected at the next step's emit (the flush in
    # flight as they were queued may already have read them); else the next step reads them at once
    assert steps <= 2 if ride_reads else steps == 1
    busy_reads = len(own_reads) - reads_before
    if ride_reads:  # a read that found requests is followed by one of the loop's own (a burst may go on)
        worker.run_once()
        assert len(own_reads) - reads_before == 1
        worker.run_once()  # which found nothing: the reads ride again
        assert len(own_reads) - reads_before == 1
    run_until_idle(worker)
    if ride_reads:
        assert busy_reads == 0 and pipelined_reads(slow) >= steps
    else:
        assert busy_reads == steps and pipelined_reads(slow) == 0
    requests = first + later
    check_answers(read_streams(client, [r.request_id for r in requests]), reference_tokens(target, requests))
    assert_queue_empty(client, stream, timeout=0)


def test_a_ridden_read_whose_reply_is_lost_loses_no_request(redis_url, client, target):
    stream = "ride-lost:requests"
    armed = {"at": None, "fired": False}

    def fail(n):
        if n == armed["at"]:
            armed["fired"] = True
            return "after"
        return None

    worker, slow, _ = make_worker(redis_url, target, stream, True, fail=fail)
    first = make_requests(1, seed=43, prefix="rlf", max_new_tokens=(60,), ignore_eos=True)
    later = make_requests(2, seed=44, prefix="rll", max_new_tokens=(20, 30))
    enqueue(client, stream, first)
    worker.run_once()
    worker.run_once()
    while worker.writer.in_flight and not worker.writer._future.done():  # its read done before the enqueue
        time.sleep(0.001)
    enqueue(client, stream, later)
    armed["at"] = slow._count  # the next flush carries a read that takes them, and its reply is lost
    worker.run_once()
    run_until_idle(worker)
    assert armed["fired"] and worker.num_reclaimed == 0  # read back, not reclaimed
    requests = first + later
    want = reference_tokens(target, requests)
    got = read_like_the_gateway(redis_url, [r.request_id for r in requests], timeout=10)
    for r in requests:
        assert got[r.request_id][-1].kind == "final" and delivered_tokens(got[r.request_id]) == want[r.request_id]
    assert_queue_empty(client, stream, timeout=0)
