"""SPECD_TRACE_STEPS through the verifier's loop and SPECD_DRAFTER_TRACE_STEPS through the
drafter's steps (specd/step_trace.py): a profiler trace of exactly the window's steps is written,
the answers stay the target's own, and bad settings are refused with the variable named."""

from __future__ import annotations

import gzip
import json

import pytest
import redis
import torch

from bench.trace_summary import load_events, step_ranges_table
from services.drafter.server import load_drafter, start_server
from specd.messages import SpeculativeConfig
from specd.proposers.base import DraftRequest
from specd.clients.drafter import RemoteProposer
from specd.sampling_params import SamplingParams
from specd import settings
from specd.step_trace import DRAFTER_TRACE_FILE, TRACE_FILE, StepTracer, TraceWindow

TRACE_STEPS_ENV, TRACE_DIR_ENV = settings.TRACE_STEPS.name, settings.TRACE_DIR.name
DRAFTER_TRACE_STEPS_ENV = settings.DRAFTER_TRACE_STEPS.name
from services.verifier.worker import VerifierWorker
from services.verifier.worker_types import WorkerConfig
from tests.engine.test_staged_verify import FullDrafts, static_engine
from tests.services.emit_helpers import enqueue, read_streams, run_until_idle
from tests.services.verifier_harness import check_answers, make_requests, reference_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_window_of_steps_is_traced(redis_url, client, target, tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_STEPS_ENV, "3:4")
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path / "trace"))
    engine = static_engine(target, stage=None, wrapper=FullDrafts, carry=0)
    worker = VerifierWorker(engine, redis.Redis.from_url(redis_url),
                            WorkerConfig(consumer="traced", request_stream="traced:requests", log_interval_s=0))
    worker.ensure_group()
    marks: list[tuple[int, bool]] = []  # (steps done, profiler on) at each step's start
    started = worker.tracer.started

    def spy():
        started()
        marks.append((worker.tracer.num_steps, worker.tracer._profiler is not None))
    worker.tracer.started = spy
    requests = make_requests(3, seed=5, prefix="traced", max_new_tokens=(12, 20))
    enqueue(client, "traced:requests", requests)
    run_until_idle(worker)
    worker.finish_writes()
    check_answers(read_streams(client, [r.request_id for r in requests]), reference_tokens(target, requests))
    assert [n for n, on in marks if on] == [3, 4, 5, 6]  # exactly the window
    path = tmp_path / "trace" / TRACE_FILE
    assert worker.tracer.path == str(path)
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert any(e["name"] == "aten::linear" for e in ops)  # the forwards' host ops (the CPU's activity)


def test_a_loop_ending_inside_the_window_still_writes_it(tmp_path):
    tracer = StepTracer(TraceWindow(1, 100, str(tmp_path)), None)
    for _ in range(3):
        tracer.started()
        sum(range(1000))
        tracer.done()
    assert tracer.path is None
    tracer.close()
    assert tracer.path == str(tmp_path / TRACE_FILE)
    tracer.close()  # once only


@pytest.mark.parametrize("text, message", [("x:3", "FIRST:COUNT (integers)"), ("2:0", "COUNT >= 1"),
                                           ("-1:2", "FIRST >= 0")])
def test_bad_windows_are_refused(text, message):
    with pytest.raises(ValueError, match=TRACE_STEPS_ENV) as e:
        TraceWindow.parse(text)
    assert message in str(e.value)


def test_unset_traces_nothing():
    assert TraceWindow.parse("") is None
    assert TraceWindow.parse("7") == TraceWindow(7, 1, ".")


def _eagle3_drafter(tiny_models):
    target = tiny_models["target-llama"]
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, model=str(tiny_models["draft-eagle3"]))
    return load_drafter(target, spec, target, max_num_draft_tokens=8)


def test_a_window_of_the_drafters_steps_is_traced(tiny_models, tmp_path, monkeypatch):
    """Steps 2-4 of seven, served over the fast path: each traced step holds its named ranges,
    the host's ops with them; the drafts are unchanged by the tracing."""
    monkeypatch.setenv(DRAFTER_TRACE_STEPS_ENV, "2:3")
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    servers = [start_server(_eagle3_drafter(tiny_models), "127.0.0.1", 0, max_workers=4)]
    monkeypatch.delenv(DRAFTER_TRACE_STEPS_ENV)
    servers.append(start_server(_eagle3_drafter(tiny_models), "127.0.0.1", 0, max_workers=4))  # untraced
    assert servers[1].servicer.tracer is None
    width = servers[0].servicer.hidden_size
    gen = torch.Generator().manual_seed(0)
    drafts = [[], []]
    try:
        remotes = [RemoteProposer([s.address]) for s in servers]
        for i in range(4):
            for remote in remotes:
                remote.open(i, SamplingParams())
        for step in range(7):
            rows = torch.randn(4, 3 if step == 0 else 1, width, generator=gen)
            tokens = [5, 6, 7, 8] if step == 0 else [9 + step]
            for remote, out in zip(remotes, drafts):
                out.append([p.token_ids.tolist() for p in remote.propose(
                    [DraftRequest(i, tokens, rows[i], 3) for i in range(4)])])
        for remote in remotes:
            remote.shutdown()
    finally:
        for server in servers:
            server.stop(0.5)
    assert drafts[0] == drafts[1]
    tracer = servers[0].servicer.tracer
    assert tracer.num_steps == 7 and tracer.path == str(tmp_path / DRAFTER_TRACE_FILE)
    events = load_events(tracer.path)
    names = [e["name"] for e in events if e.get("cat") == "user_annotation"]
    for name in ("drafter step: inputs and propose", "drafter step: propose", "drafter step: answer"):
        assert names.count(name) == 3, (name, names)
    assert any(e.get("cat") == "cpu_op" and e["name"] == "aten::linear" for e in events)  # the head's ops
    table = step_ranges_table(events)
    assert "| drafter step: propose | 3 |" in table and "(3 steps)" in table


def test_a_bad_drafter_window_is_refused_at_load(tiny_models, monkeypatch):
    monkeypatch.setenv(DRAFTER_TRACE_STEPS_ENV, "1:0")
    with pytest.raises(ValueError, match=f"{DRAFTER_TRACE_STEPS_ENV}: .*COUNT >= 1"):
        _eagle3_drafter(tiny_models)
