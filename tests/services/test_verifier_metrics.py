"""The verifier's loop figures: the CUDA-graph capture counters (a capture stalls the loop, ~0.3-0.5
s at 8B, so the e2e bench reads how many landed in each timed round, bench/e2e.py), and the step
phases (StepRecord): an idle loop's blocked wait for work stays out of "rest"."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import generate_latest

from bench.e2e import step_split_ms
from services.verifier.metrics import VerifierMetrics
from tests.services.verifier_harness import collect, enqueue, make_requests, make_worker


def _value(metrics: VerifierMetrics, name: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_capture_totals_become_counter_increments():
    m = VerifierMetrics()
    m.observe_captures(0, 0.0)  # the CPU runner: nothing captured, nothing counted
    assert _value(m, "specd:cuda_graph_captures_total") == 0
    m.observe_captures(3, 1.5)
    m.observe_captures(3, 1.5)  # the same totals again (a step without a capture): no change
    m.observe_captures(4, 2.25)
    assert _value(m, "specd:cuda_graph_captures_total") == 4
    assert _value(m, "specd:cuda_graph_capture_seconds_total") == 2.25
    assert _value(m, "specd:cuda_graph_capture_failures_total") == 0
    m.observe_captures(4, 2.25, 1)  # a layout whose graph did not fit (StaticForward._capture_failed)
    m.observe_captures(5, 2.75, 1)
    assert _value(m, "specd:cuda_graph_capture_failures_total") == 1
    assert _value(m, "specd:cuda_graph_captures_total") == 5


def test_the_bench_splits_captures_and_prefills_out_of_the_phases():
    before = {"verify": (1.0, 10.0), "rest": (0.5, 10.0), "captures": (1.0, 2.0), "prefills": (3.0, 1.0)}
    after = {"verify": (2.0, 20.0), "rest": (0.7, 20.0), "captures": (1.6, 3.0), "prefills": (5.0, 4.0)}
    split = step_split_ms(before, after)
    assert split == {"verify": 100.0, "rest": 20.0, "steps": 10, "captures": 1, "capture_s": 0.6,
                     "prefills": 5, "eager_prefills": 3}


def test_prefill_forwards_are_counted_by_path_and_timed_out_of_rest():
    from services.verifier.metrics import StepRecord

    m = VerifierMetrics()
    record = StepRecord(draft_seconds=0.001, verify_seconds=0.002, engine_seconds=0.01, total_seconds=0.012,
                        device_wait_seconds=0.001, commit_seconds=0.001, emit_seconds=0.001,
                        prefill_seconds=0.004, num_prefills=1, num_eager_prefills=1)
    m.observe_step(record)
    m.observe_step(StepRecord(engine_seconds=0.01, total_seconds=0.01, prefill_seconds=0.002, num_prefills=1))
    assert record.rest_seconds == pytest.approx(0.012 - 0.003 - 0.003 - 0.004)
    assert _value(m, 'specd:prefill_forwards_total{path="eager"}') == 1
    assert _value(m, 'specd:prefill_forwards_total{path="static"}') == 1
    assert _value(m, 'specd:step_duration_seconds_sum{phase="prefill"}') == pytest.approx(0.006)


def test_drafter_round_trips_are_observed_once_and_averaged_per_round_trip():
    from specd.clients.drafter import DraftRoundTrip

    m = VerifierMetrics()
    rt = DraftRoundTrip(queued=0.001, transit=0.002, handle=0.003, waited=0.0005)
    m.observe_round_trip(1, rt)
    m.observe_round_trip(1, rt)  # the same round trip (a step that sent none): not again
    m.observe_round_trip(2, DraftRoundTrip(queued=0.003, transit=0.002, handle=0.001, waited=0.0015))
    assert _value(m, 'specd:drafter_round_trip_seconds_count{part="queued"}') == 2
    assert _value(m, 'specd:drafter_round_trip_seconds_sum{part="queued"}') == pytest.approx(0.004)
    # the bench: per round trip, not per step (here 2 round trips over 4 steps)
    before = {"verify": (0.0, 0.0), "round trip queued": (0.0, 0.0)}
    after = {"verify": (0.4, 4.0), "round trip queued": (0.004, 2.0)}
    assert step_split_ms(before, after)["round trip queued"] == pytest.approx(2.0)
    assert step_split_ms(before, after)["verify"] == pytest.approx(100.0)


@pytest.mark.usefixtures("one_torch_thread")
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


def test_the_device_clock_is_a_phase_and_the_bench_prints_it():
    from bench.e2e import E2ERow, format_row
    from services.verifier.metrics import StepRecord

    m = VerifierMetrics()
    m.observe_step(StepRecord(engine_seconds=0.01, total_seconds=0.01, verify_seconds=0.002,
                              device_wait_seconds=0.005, device_launch_seconds=0.0002,
                              device_forward_seconds=0.0055, device_step_seconds=0.0065,
                              launch_mark_seconds=0.0003))
    assert _value(m, 'specd:step_duration_seconds_sum{phase="device_launch"}') == pytest.approx(0.0002)
    assert _value(m, 'specd:step_duration_seconds_sum{phase="device_forward"}') == pytest.approx(0.0055)
    assert _value(m, 'specd:step_duration_seconds_sum{phase="device_step"}') == pytest.approx(0.0065)
    assert _value(m, 'specd:step_duration_seconds_sum{phase="launch_mark"}') == pytest.approx(0.0003)
    before = {"verify": (0.0, 0.0), "device_launch": (0.0, 0.0), "device_forward": (0.0, 0.0),
              "device_step": (0.0, 0.0)}
    after = {"verify": (0.02, 10.0), "device_launch": (0.002, 10.0), "device_forward": (0.055, 10.0),
             "device_step": (0.065, 10.0), "launch_mark": (0.003, 10.0)}
    split = step_split_ms(before, after)
    row = E2ERow("replay", 1, 128, 0.3, 400.0, 2.5, 2.8, step_ms=split)
    assert "; device clock: launch 0.20 / forward 5.50 / step 6.50; host in the launch mark 0.30)" in format_row(row)
    assert "device clock" not in format_row(E2ERow("off", 1, 128, 0.8, 160.0, 6.2, 1.0, step_ms={"verify": 1.0}))


def test_the_forward_by_batch_kind_is_scraped_and_printed():
    """The verify forward's own device time by whether its batch was staged: a histogram per
    kind, read over HTTP by the e2e bench per forward (not per step) and printed with the clock."""
    from bench.e2e import E2ERow, format_row, scrape_step_phases
    from services.verifier.metrics import StepRecord
    from specd.transport.ports import free_port

    m = VerifierMetrics()
    step = dict(engine_seconds=0.01, total_seconds=0.01, device_launch_seconds=0.0001,
                device_forward_seconds=0.006, device_step_seconds=0.0062)
    for kind, seconds in (("staged", 0.006), ("staged", 0.0058), ("unstaged", 0.0055), ("", 0.0)):
        m.observe_step(StepRecord(**step, forward_kind=kind, forward_own_seconds=seconds))
    port = free_port()
    server, _ = m.serve(port, addr="127.0.0.1")
    try:
        split = step_split_ms({}, scrape_step_phases(port))
    finally:
        server.shutdown()
    assert split["forward staged"] == pytest.approx(5.9) and split["forward staged n"] == 2
    assert split["forward unstaged"] == pytest.approx(5.5) and split["forward unstaged n"] == 1
    assert split["steps"] == 4  # the kinds are not step phases: every step counts
    assert _value(m, "specd:emit_duration_seconds_count") == 4  # every step's emit, forward or not
    row = format_row(E2ERow("replay", 1, 128, 0.3, 400.0, 2.5, 2.8, step_ms=split))
    assert "; forward's own, by batch: staged 5.90 (2) / unstaged 5.50 (1))" in row


def test_commit_parts_are_phases_and_the_bench_prints_them():
    from bench.e2e import E2ERow, format_row
    from services.verifier.metrics import StepRecord

    m = VerifierMetrics()
    m.observe_step(StepRecord(engine_seconds=0.01, total_seconds=0.01, commit_seconds=0.004,
                              send_ahead_seconds=0.003, stage_seconds=0.0005))
    assert _value(m, 'specd:step_duration_seconds_sum{phase="send_ahead"}') == pytest.approx(0.003)
    assert _value(m, 'specd:step_duration_seconds_sum{phase="stage"}') == pytest.approx(0.0005)
    split = {"draft": 1.0, "verify": 2.0, "device_wait": 3.0, "commit": 4.0, "send_ahead": 3.0, "stage": 0.5,
             "emit": 0.1, "prefill": 0.0, "rest": 0.2, "steps": 10}
    row = E2ERow("eagle3", 128, 1024, 1.0, 1000.0, 40.0, 1.0, step_ms=split)
    assert "| 1.00 / 2.00 / 3.00 / 4.00 (3.00 / 0.50) / 0.10 / 0.00 / 0.20 (10" in format_row(row)
    assert "4.00 / 0.10" in format_row(E2ERow("off", 1, 128, 0.8, 160.0, 6.2, 1.0,
                                              step_ms={k: v for k, v in split.items() if k != "stage"}))


def test_the_round_trips_send_parts_are_observed_and_printed():
    from bench.e2e import E2ERow, format_row
    from specd.clients.drafter import DraftRoundTrip

    m = VerifierMetrics()
    m.observe_round_trip(1, DraftRoundTrip(queued=0.001, transit=0.002, handle=0.003, waited=0.0005,
                                           to_host=0.0004, encode=0.0012, write=0.0021))
    assert _value(m, 'specd:drafter_round_trip_seconds_sum{part="write"}') == pytest.approx(0.0021)
    split = {"verify": 1.0, "steps": 4, "round trip queued": 1.0, "round trip transit": 2.0,
             "round trip handle": 3.0, "round trip waited": 0.5, "round trip to_host": 0.4,
             "round trip encode": 1.2, "round trip write": 2.1}
    assert "; round trip 1.00 / 2.00 / 3.00 / 0.50; its send 0.40 / 1.20 / 2.10" in format_row(
        E2ERow("eagle3", 64, 1024, 1.0, 1000.0, 10.0, 1.0, step_ms=split))


def test_the_drafters_propose_share_is_observed_and_printed_inside_its_handle_time():
    from bench.e2e import E2ERow, format_row
    from specd.clients.drafter import DraftRoundTrip

    m = VerifierMetrics()
    m.observe_round_trip(1, DraftRoundTrip(queued=0.001, transit=0.002, handle=0.003, waited=0.0005,
                                           propose=0.0025))
    assert _value(m, 'specd:drafter_round_trip_seconds_sum{part="propose"}') == pytest.approx(0.0025)
    split = {"verify": 1.0, "steps": 4, "round trip queued": 1.0, "round trip transit": 2.0,
             "round trip handle": 3.0, "round trip propose": 2.5, "round trip waited": 0.5}
    assert "; round trip 1.00 / 2.00 / 3.00 (2.50) / 0.50" in format_row(
        E2ERow("eagle3", 64, 1024, 1.0, 1000.0, 10.0, 1.0, step_ms=split))


def test_chosen_draft_lengths_are_counted_by_k():
    from services.verifier.metrics import StepRecord

    m = VerifierMetrics()
    m.observe_step(StepRecord(draft_lengths=[2, 0, 0, 5]))
    m.observe_step(StepRecord(draft_lengths=[3], undrafted=1))
    assert _value(m, 'specd:spec_decode_draft_length_total{k="0"}') == 5
    assert _value(m, 'specd:spec_decode_draft_length_total{k="3"}') == 5
    assert _value(m, "specd:spec_decode_undrafted_steps_total") == 1


def test_prompt_tokens_are_counted_by_source_through_a_worker(redis_url, client, target):
    """Two requests with one long shared prefix, one after the other: the second's prefix comes
    from the prefix cache, and the verifier's metrics say how many tokens came from where."""
    from specd.sampling_params import SamplingParams
    from specd.transport.redis_streams import QueuedRequest

    stream = "metrics-prefix:requests"
    worker = make_worker(redis_url, target, stream)
    shared = [5 + (3 * i) % 200 for i in range(70)]
    for i in range(2):
        enqueue(client, stream, [QueuedRequest(f"pc{i}", shared + [7 + i], SamplingParams(max_new_tokens=3))])
        for _ in range(20):
            worker.run_once()
            if not worker.active and not worker.engine.has_unfinished():
                break
    hits = _value(worker.metrics, 'specd:prefill_prompt_tokens_total{source="prefix_cache"}')
    computed = _value(worker.metrics, 'specd:prefill_prompt_tokens_total{source="prefill"}')
    assert hits >= 64 and computed + hits == 2 * 71
