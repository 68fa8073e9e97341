"""SPECD_STAGE_VERIFY=late through the verifier's loop (specd/engine/staging.py): the next verify
batch is staged after the step's result flush was handed to the writer thread, not inside the
step; the answers are the target's own, token for token, over a real Redis."""

from __future__ import annotations

import pytest
import redis
from prometheus_client import generate_latest

from services.verifier.worker import VerifierWorker
from services.verifier.worker_types import WorkerConfig
from tests.engine.test_staged_verify import FullDrafts, static_engine
from tests.services.emit_helpers import enqueue, read_streams, run_until_idle
from tests.services.verifier_harness import check_answers, make_requests, reference_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_loop_stages_after_handing_over_its_flush(redis_url, client, target):
    engine = static_engine(target, stage="late", wrapper=FullDrafts, carry=0)
    worker = VerifierWorker(engine, redis.Redis.from_url(redis_url),
                            WorkerConfig(consumer="late", request_stream="late:requests", log_interval_s=0,
                                         async_emit=True))
    worker.ensure_group()
    events: list[str] = []  # per loop iteration: its flush handed over, then its stage

    def spied(name, fn):
        def call(*args, **kwargs):
            if name == "iteration":
                events.append(name)
            staged = engine.runner.staged
            out = fn(*args, **kwargs)
            if name == "flush" and out or name == "stage" and engine.runner.staged and not staged:
                events.append(name)  # a flush handed over; a batch staged by this very call
            return out
        return call

    worker.run_once = spied("iteration", worker.run_once)
    worker.writer.start = spied("flush", worker.writer.start)
    engine.stage_next_verify = spied("stage", engine.stage_next_verify)
    requests = make_requests(6, seed=21, prefix="late", max_new_tokens=(24, 40))
    enqueue(client, "late:requests", requests)
    run_until_idle(worker)
    worker.finish_writes()
    check_answers(read_streams(client, [r.request_id for r in requests]), reference_tokens(target, requests))
    stages = [i for i, e in enumerate(events) if e == "stage"]
    assert len(stages) == engine.runner.num_staged_forwards > 5
    assert all(events[i - 1] == "flush" for i in stages), events
    # The loop's metrics count each verify forward by its batch's kind (the e2e bench's split).
    counts = {line.split('"')[1]: float(line.rsplit(" ", 1)[1])
              for line in generate_latest(worker.metrics.registry).decode().splitlines()
              if line.startswith("specd:verify_forward_device_seconds_count{")}
    assert counts["staged"] == engine.runner.num_staged_forwards
    assert counts["staged"] + counts["unstaged"] == engine.stats.num_steps
