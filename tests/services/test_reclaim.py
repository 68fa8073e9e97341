"""Verifier death, in-process against a real Redis: a survivor reclaims the entries of a verifier
that stopped heartbeating and resumes each request from its result stream, with no gap and no
duplicate; a live verifier's heartbeat keeps its entries; a stalled one that lost them drops them;
answered-but-unacknowledged and poisonous entries are settled without running them again."""

from __future__ import annotations

import time

import pytest

from services.verifier.claims import ClaimConfig
from services.verifier.results.flush import ResultQueue
from specd.engine.builder import build_engine
from specd.messages import ConfigError, PytorchEngineConfig, SpecStats
from specd.transport.redis_streams import CONSUMER_GROUP, QueuedRequest, ResultEntry, result_key
from specd.transport.resume import ResultGapError, replay_results
from specd.sampling_params import SamplingParams
from tests.services.fault_helpers import ENGINE, NGRAM, delivered_tokens, make_worker, read_like_the_gateway
from tests.services.verifier_harness import (assert_queue_empty, check_answers, collect, enqueue, make_requests,
                                             reference_tokens)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run_until(worker, done, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        worker.run_once()


# ---- the resume point ----------------------------------------------------------------------------
def test_replay_folds_duplicates_and_carries_the_stats():
    stats = SpecStats(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3, accepted_per_position=[2, 1, 0])
    entries = [ResultEntry("delta", 0, [5, 6]), ResultEntry("delta", 2, [7], spec_stats=stats),
               ResultEntry("delta", 1, [6, 7, 8]),  # a partly repeated write: only 8 is new
               ResultEntry("delta", 4, [])]
    point = replay_results(entries)
    assert point.output_token_ids == [5, 6, 7, 8] and not point.is_answered
    assert point.spec_stats == stats
    assert replay_results(entries + [ResultEntry("final", 4, [9], finish_reason="length")]).is_answered
    assert replay_results([ResultEntry("error", 0, code=504)]).is_answered
    with pytest.raises(ResultGapError):
        replay_results([ResultEntry("delta", 0, [5]), ResultEntry("delta", 3, [9])])


def test_claim_config_is_validated():
    assert ClaimConfig(idle_ms=2000).heartbeat_ms == 500 and ClaimConfig(idle_ms=2000).scan_ms == 1000
    assert not ClaimConfig(idle_ms=0).enabled
    for bad in (dict(idle_ms=-1), dict(idle_ms=50), dict(idle_ms=1000, heartbeat_ms=1000),
                dict(idle_ms=1000, max_deliveries=1)):
        with pytest.raises(ConfigError):
            ClaimConfig(**bad)


# ---- death and resume ------------------------------------------------------------------------------
def test_survivor_resumes_a_dead_verifiers_requests(redis_url, client, target):
    stream = "reclaim-death:requests"
    requests = make_requests(6, seed=11, prefix="rd", max_new_tokens=(40,), ignore_eos=True, stop_token_ids=[])
    ids = [r.request_id for r in requests]
    dead = make_worker(redis_url, target, stream, "dead")
    enqueue(client, stream, requests)
    for _ in range(4):  # admitted, a few steps emitted, then the verifier is gone (never called again)
        dead.run_once()
    died_at = time.monotonic()
    written = {rid: replay_results([ResultEntry.from_fields(f) for _, f in client.xrange(result_key(rid))])
               for rid in ids}
    assert all(0 < p.num_output_tokens < 40 and not p.is_answered for p in written.values())
    assert client.xpending(stream, CONSUMER_GROUP)["pending"] == 6

    survivor = make_worker(redis_url, target, stream, "survivor", idle_ms=300)
    _run_until(survivor, lambda: survivor.num_reclaimed == 6)
    reclaim_s = time.monotonic() - died_at
    _run_until(survivor, lambda: not survivor.active)
    print(f"\nreclaimed 6 requests {reclaim_s:.2f} s after the verifier stopped (idle limit 0.3 s, "
          "survivor start included)")
    assert 0.3 - 0.075 <= reclaim_s < 30  # idle counts from the last heartbeat (every 75 ms)

    # The raw streams: positions contiguous from 0, one final, exactly the target's tokens.
    results = collect(client, ids, timeout=5)
    check_answers(results, reference_tokens(target, requests))
    for rid in ids:  # the survivor's first write starts exactly where the dead one stopped
        assert written[rid].num_output_tokens in [e.pos for e in results[rid]], rid
    assert_queue_empty(client, stream)
    assert survivor.num_finished == 6 and dead.num_finished == 0

    # Stats carry over: with n-gram drafts (a function of the tokens), the resumed requests made the
    # same drafts as a fault-free run, so their figures are the fault-free ones exactly.
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=8, **ENGINE), NGRAM)
    fault_free = engine.generate([r.prompt_token_ids for r in requests], [r.params for r in requests])
    for rid, seq in zip(ids, fault_free):
        assert results[rid][-1].spec_stats == seq.stats, rid
    assert sum(s.stats.num_draft_tokens for s in fault_free) > 0


def test_heartbeat_keeps_a_slow_verifier_and_a_stalled_one_drops_what_it_lost(redis_url, client, target):
    stream = "reclaim-stall:requests"
    requests = make_requests(3, seed=12, prefix="rs", max_new_tokens=(90,), ignore_eos=True, stop_token_ids=[])
    ids = [r.request_id for r in requests]
    # One loop round is the slow one's step, the other's idle XREADGROUP (BLOCK 100 ms) and a
    # 150 ms sleep: ~0.3 s here, and more on a loaded machine. The idle limit leaves it a wide
    # margin (a 400 ms limit flaked in CI); the largest gap between the slow one's steps is checked.
    idle_ms = 1200
    slow = make_worker(redis_url, target, stream, "slow", idle_ms=idle_ms)
    other = make_worker(redis_url, target, stream, "other", idle_ms=idle_ms)
    enqueue(client, stream, requests)
    slow.run_once()
    assert len(slow.active) == 3
    t_end = time.monotonic() + 2.5 * idle_ms / 1000  # past two idle limits: heartbeats keep it
    last, widest = time.monotonic(), 0.0
    while time.monotonic() < t_end:
        slow.run_once()
        now = time.monotonic()
        last, widest = now, max(widest, now - last)
        other.run_once()
        time.sleep(0.15)
    assert widest < idle_ms / 1000, f"the machine is too slow for this test: {widest:.2f} s between steps"
    assert other.num_reclaimed == 0 and len(slow.active) == 3

    time.sleep(1.5 * idle_ms / 1000)  # the slow one stalls past the idle limit: the other takes over
    _run_until(other, lambda: other.num_reclaimed == 3, timeout=10)
    slow.run_once()  # its heartbeat finds the entries gone: it stops running them, once the answer
    slow.run_once()  # is in (a step later: the round trip overlaps the next step, async_emit)
    assert slow.num_lost == 3 and not slow.active and not slow.engine.has_unfinished()
    _run_until(other, lambda: not other.active)
    slow.run_once()

    # Both wrote deltas around the hand-over (the raw streams hold some tokens twice); the gateway's
    # reader delivers each token once.
    raw = {rid: [ResultEntry.from_fields(f) for _, f in client.xrange(result_key(rid))] for rid in ids}
    assert sum(len(e.tokens) for rid in ids for e in raw[rid]) > sum(len(t) for t in reference_tokens(
        target, requests).values())
    got = read_like_the_gateway(redis_url, ids, timeout=10)
    want = reference_tokens(target, requests)
    for rid in ids:
        assert [e.kind for e in got[rid]][-1] == "final"
        assert delivered_tokens(got[rid]) == want[rid], rid
    assert slow.num_finished == 0 and other.num_finished == 3
    assert_queue_empty(client, stream)


def test_answered_but_unacknowledged_entry_is_only_acknowledged(redis_url, client, target):
    stream = "reclaim-answered:requests"
    request = QueuedRequest("ra-0", [5, 6, 7], SamplingParams(max_new_tokens=4))
    enqueue(client, stream, [request])
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    client.xreadgroup(CONSUMER_GROUP, "ghost", {stream: ">"}, count=1)  # read, answered, died before XACK
    result_queue = ResultQueue(client, stream)
    result_queue.final("ra-0", 0, [9, 9, 9, 9], "length", SpecStats(), prompt_tokens=3)
    result_queue.flush()
    worker = make_worker(redis_url, target, stream, "survivor", idle_ms=100)
    time.sleep(0.15)
    worker.run_once()
    worker.run_once()
    assert worker.num_reclaimed == 0 and not worker.active
    assert client.xlen(result_key("ra-0")) == 1  # nothing run, nothing written again
    assert_queue_empty(client, stream)


def test_a_request_that_keeps_killing_verifiers_is_failed(redis_url, client, target):
    stream = "reclaim-poison:requests"
    request = QueuedRequest("rp-0", [5, 6, 7], SamplingParams(max_new_tokens=4))
    enqueue(client, stream, [request])
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    [[_, [(entry_id, _)]]] = client.xreadgroup(CONSUMER_GROUP, "ghost", {stream: ">"}, count=1)
    for _ in range(4):  # four more verifiers took it and died: delivered 5 times
        client.xclaim(stream, CONSUMER_GROUP, "ghost", 0, [entry_id])
    worker = make_worker(redis_url, target, stream, "survivor", idle_ms=100)
    time.sleep(0.15)
    worker.run_once()
    worker.run_once()
    [entry] = collect(client, ["rp-0"], timeout=5)["rp-0"]
    assert entry.kind == "error" and entry.code == 500 and "claimed 6 times" in entry.message
    assert worker.num_reclaimed == 0 and worker.num_errors == 1
    assert_queue_empty(client, stream)


def test_an_entry_deleted_while_pending_is_acknowledged(redis_url, client, target):
    stream = "reclaim-deleted:requests"
    gone = QueuedRequest("rx-0", [5, 6, 7], SamplingParams(max_new_tokens=4))
    live = QueuedRequest("rx-1", [8, 9], SamplingParams(max_new_tokens=4))
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    gone_id = client.xadd(stream, gone.to_fields())
    client.xadd(stream, live.to_fields())
    client.xreadgroup(CONSUMER_GROUP, "ghost", {stream: ">"}, count=2)
    client.xdel(stream, gone_id)  # deleted but never acknowledged: Redis 6.2 reclaims it as nil
    worker = make_worker(redis_url, target, stream, "survivor", idle_ms=100)
    time.sleep(0.15)
    _run_until(worker, lambda: worker.num_reclaimed == 1 and not worker.active, timeout=20)
    worker.run_once()
    check_answers(collect(client, ["rx-1"], timeout=5), reference_tokens(target, [live]))
    assert_queue_empty(client, stream)


def test_a_heartbeat_is_one_xpending_whatever_the_batch(client):
    """The heartbeat script reads the consumer's pending list once (not once per entry) and still
    tells the entries another consumer took."""
    from services.verifier.claims import ClaimConfig, Claims

    stream, group = "heartbeat-count:requests", "g"
    client.delete(stream)
    client.xgroup_create(stream, group, id="0", mkstream=True)
    ids = [client.xadd(stream, {"n": i}) for i in range(40)]
    client.xreadgroup(group, "a", {stream: ">"}, count=40)
    client.xclaim(stream, group, "b", 0, ids[:5], justid=True)  # a survivor took five of them

    def xpending_calls() -> int:
        return int(client.info("commandstats").get("cmdstat_xpending", {}).get("calls", 0))

    time.sleep(0.4)  # idle 400 ms: the heartbeat resets it
    claims = Claims(client, stream, group, "a", ClaimConfig(idle_ms=1000))
    rider = claims.heartbeat(ids, now=0.0)
    before = xpending_calls()
    pipe = client.pipeline(transaction=False)
    rider.queue(pipe)
    rider.answer(pipe.execute(raise_on_error=False))
    assert rider.answered and xpending_calls() - before == 1
    assert sorted(rider.lost) == sorted(ids[:5])
    idle = {p["message_id"]: p["time_since_delivered"]
            for p in client.xpending_range(stream, group, min="-", max="+", count=100, consumername="a")}
    assert set(idle) == set(ids[5:]) and max(idle.values()) < 300
