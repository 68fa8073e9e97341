"""The verifier loop's step phases (services/verifier/metrics.py StepRecord): the time an idle loop
spends blocked on the stream waiting for work is not the loop's own, so it stays out of "rest"."""

from __future__ import annotations

import threading
import time

import pytest

from tests.services.test_verifier import collect, enqueue, make_requests, make_worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_idle_wait_for_a_request_is_not_counted_as_rest(redis_url, client, target):
    stream = "phases-idle:requests"
    worker = make_worker(redis_url, target, stream)
    worker.config.block_ms = 3000  # the idle read blocks long enough to tell the wait apart
    request = make_requests(1, seed=7, prefix="phases", max_new_tokens=(4,))[0]
    records = []
    loop = threading.Thread(target=lambda: records.append(worker.run_once()))
    loop.start()
    time.sleep(0.8)  # the loop is blocked in XREADGROUP meanwhile
    enqueue(client, stream, [request])
    loop.join(timeout=30)
    assert not loop.is_alive()
    record = records[0]
    assert record.num_admitted == 1 and record.engine_seconds > 0  # admitted and stepped
    # The 0.8 s before the request existed is not in the iteration's time; its prefill and
    # first step are (a tiny model on CPU: well under that).
    assert 0 < record.total_seconds < 0.5, record
    assert record.rest_seconds < 0.5
    while worker.engine.has_unfinished():
        worker.run_once()
    worker.finish_writes()
    entries = collect(client, [request.request_id])[request.request_id]
    assert entries[-1].kind == "final" and sum(len(e.tokens) for e in entries) == 4
