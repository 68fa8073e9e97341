"""The result streams' TTL (services/verifier/results/flush.py): an EXPIRE with a stream's first write,
its last, and any write a tenth of the TTL after its last EXPIRE, not one per stream per step;
against the real Redis, the clock stepped by hand."""

from __future__ import annotations

import pytest

from services.verifier.results import flush as flush_module
from services.verifier.results.flush import ResultQueue
from specd.transport.redis_streams import result_key

TTL = 600


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(flush_module.time, "monotonic", c)
    return c


def flush(em: ResultQueue) -> list[str]:
    """Send the queue; the streams whose TTL it refreshed."""
    f = em.prepare()
    f.execute()
    em.complete(f)
    assert not em.last_errors
    return f.expired_keys


def test_first_write_then_a_tenth_of_the_ttl_then_the_last(client, clock):
    em = ResultQueue(client, "specd:ttl:requests", ttl_seconds=TTL)
    key = result_key("ttl-a")
    client.delete(key)
    em.delta("ttl-a", 0, [5])
    assert flush(em) == [key] and 0 < client.ttl(key) <= TTL
    for step in range(1, 6):  # steps within a tenth of the TTL: XADDs only
        clock.now += 10
        em.delta("ttl-a", step, [5])
        assert flush(em) == []
    clock.now += TTL / 10 - 50 + 1  # a tenth of the TTL since the stream's last EXPIRE
    em.delta("ttl-a", 6, [5])
    assert flush(em) == [key]
    clock.now += 1
    em.final("ttl-a", 7, [6], "stop", None, prompt_tokens=3)
    assert flush(em) == [key] and key not in em._refreshed  # the last entry: forgotten
    assert client.xlen(key) == 8


def test_a_stream_that_expired_in_a_stall_gets_its_ttl_back(client, clock):
    em = ResultQueue(client, "specd:ttl:requests", ttl_seconds=TTL)
    key = result_key("ttl-b")
    em.delta("ttl-b", 0, [5])
    flush(em)
    client.delete(key)  # as Redis does a TTL after the last EXPIRE: the verifier stalled that long
    clock.now += TTL
    em.delta("ttl-b", 1, [5])
    assert flush(em) == [key] and 0 < client.ttl(key) <= TTL


def test_a_failed_flush_sends_its_expire_again(client, clock):
    em = ResultQueue(client, "specd:ttl:requests", ttl_seconds=TTL)
    key = result_key("ttl-c")
    client.delete(key)
    em.delta("ttl-c", 0, [5])
    failed = em.prepare()
    assert failed.expired_keys == [key]
    em.requeue(failed)  # Redis was unreachable: nothing went through
    em.delta("ttl-c", 1, [5])
    assert flush(em) == [key] and 0 < client.ttl(key) <= TTL and client.xlen(key) == 2


def test_a_final_requeued_behind_new_deltas_still_expires(client, clock):
    em = ResultQueue(client, "specd:ttl:requests", ttl_seconds=TTL)
    key = result_key("ttl-d")
    em.delta("ttl-d", 0, [5])
    flush(em)
    em.final("ttl-d", 1, [], "stop", None, prompt_tokens=1)
    failed = em.prepare()
    em.requeue(failed)
    assert flush(em) == [key] and key not in em._refreshed


def test_streams_a_verifier_stopped_writing_are_forgotten(client, clock):
    """A request another verifier took over never gets its last entry here: its record goes
    once it is a TTL old (the next write, if any, would send an EXPIRE anyway)."""
    em = ResultQueue(client, "specd:ttl:requests", ttl_seconds=TTL)
    em.delta("ttl-e", 0, [5])
    flush(em)
    assert result_key("ttl-e") in em._refreshed
    clock.now += TTL + 1
    em.delta("ttl-f", 0, [5])
    flush(em)
    assert result_key("ttl-e") not in em._refreshed and result_key("ttl-f") in em._refreshed


def test_pipeline_commands_at_batch_64(client, clock):
    """The point: a steady step at batch 64 sends 64 XADDs, not 64 XADDs and 64 EXPIREs."""
    em = ResultQueue(client, "specd:ttl:requests", ttl_seconds=TTL)
    for step in range(3):
        for i in range(64):
            em.delta(f"ttl-batch-{i}", step, [5])
        f = em.prepare()
        f.execute()
        em.complete(f)
        assert len(f.replies) == (128 if step == 0 else 64)
        clock.now += 1
    assert all(0 < client.ttl(result_key(f"ttl-batch-{i}")) <= TTL for i in range(64))
