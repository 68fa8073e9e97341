"""A verify step on the device's clock (specd/engine/device_clock.py): the marks, and the engine's
running totals from them. On CPU the device is the host (HostEvent): the same code paths, timed on
the host clock; on CUDA the same marks are CUDA events (the e2e bench prints both on the GPU)."""

from __future__ import annotations

import time

import pytest
import torch

from specd.engine.builder import build_engine
from specd.engine.device_clock import DeviceClock, HostEvent
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from tests.engine.test_greedy_lossless import make_requests


def test_marks_read_once_after_a_marked_step():
    clock = DeviceClock(torch.device("cpu"))
    assert clock.read() is None  # nothing marked yet
    clock.start()
    time.sleep(0.001)
    clock.launching()
    time.sleep(0.002)
    clock.forward_queued()
    time.sleep(0.003)
    clock.step_queued()
    launch, forward, step, launch_mark_host, staged = clock.read()
    assert 0.001 <= launch and forward - launch >= 0.002 and step - forward >= 0.003
    assert 0 <= launch_mark_host < 0.001  # the record alone: no other thread waited for
    assert not staged
    assert clock.read() is None  # read once: a step without marks adds nothing


class _SlowRecord(HostEvent):
    """A launch event whose record gives the GIL away for a while (as a CUDA event's record does,
    when another thread then takes it)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def record(self) -> None:
        super().record()
        time.sleep(self.seconds)


def test_the_host_time_in_the_launch_mark_is_read_with_the_marks():
    """A wait inside the launch mark's record (another thread's GIL turn) is the host's, read as
    launch_mark_host; a step that marks no launch reads 0."""
    clock = DeviceClock(torch.device("cpu"))
    clock._launch = _SlowRecord(0.003)
    clock.start()
    clock.launching()
    clock.forward_queued()
    clock.step_queued()
    assert clock.read().launch_mark_host >= 0.003
    clock.start()
    clock.forward_queued()
    clock.step_queued()
    assert clock.read().launch_mark_host == 0.0


def test_a_launch_marked_before_the_start_is_not_the_steps():
    """A prefill's forward marks a launch too; the next verify step's start forgets it, and a
    runner that never marks one reads None (no launch time is made up)."""
    clock = DeviceClock(torch.device("cpu"))
    clock.launching()  # the admission's prefill, before the step
    clock.start()
    clock.forward_queued()
    clock.step_queued()
    assert clock.read().launch is None


def test_the_engine_times_each_verify_step_within_its_host_time(tiny_models):
    """The device's time to the sampling's end lies within the host's verify + device wait (here
    the same clock: the forward runs in line), the forward's end before it; prefill-only steps
    add nothing."""
    config = PytorchEngineConfig(max_batch_size=4, block_size=8, session_len=256)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    engine = build_engine(tiny_models["target-llama"], config, spec)
    prompts, params = make_requests(256, seed=3)
    engine.generate(prompts[:4], params[:4])
    t = engine.stats.timings
    assert 0 < t.device_launch < t.device_forward < t.device_step <= t.verify + t.device_wait
    assert t.device_launch <= t.launch  # the runner marks it inside verify's host launch
    assert t.device_step > 0.5 * t.verify  # the forward is most of verify on CPU


def test_the_static_path_marks_its_launch_staged_or_not(tiny_models):
    """The launch mark on the static path (the CUDA graphs' CPU twin), staged batches included:
    every verify step of a static-path engine reads a launch, after its start and before its
    forward's end."""
    from tests.engine.test_staged_verify import FullDrafts, static_engine

    for stage in (True, False):
        engine = static_engine(tiny_models["target-llama"], stage=stage, wrapper=FullDrafts)
        marks = []
        for clock in engine._clocks:  # (two in turn: overlapped decode steps)
            clock.read = (lambda read: lambda: marks.append(read()) or marks[-1])(clock.read)
        prompts, params = make_requests(256, seed=4)
        engine.generate(prompts[:3], params[:3])
        steps = [m for m in marks if m is not None]
        assert steps and all(m.launch is not None and 0 < m.launch < m.forward < m.step for m in steps)
        # Each forward's own time is counted by whether it took a staged batch: the runner's count.
        timings = engine.stats.timings
        assert sum(m.staged for m in steps) == timings.num_forward_staged == engine.runner.num_staged_forwards
        assert timings.num_forward_staged + timings.num_forward_unstaged == len(steps)
        assert timings.forward_staged == pytest.approx(sum(m.forward - m.launch for m in steps if m.staged))
        assert timings.forward_unstaged == pytest.approx(sum(m.forward - m.launch for m in steps if not m.staged))
        if stage:
            assert engine.runner.num_staged_forwards > 0 and timings.num_forward_unstaged > 0


def test_a_steps_timings_are_the_totals_added_since_a_copy():
    from specd.engine.device_clock import DeviceMarks
    from specd.engine.stats import StepTimings

    timings = StepTimings(draft=1.0, num_forward_staged=2)
    before = timings.copy()
    timings.draft += 0.25
    timings.add_device_clock(DeviceMarks(0.001, 0.006, 0.007, 0.0002, staged=True))
    step = timings.since(before)
    assert before.draft == 1.0 and step.draft == pytest.approx(0.25)
    assert step.num_forward_staged == 1 and step.forward_staged == pytest.approx(0.005)
    assert step.num_forward_unstaged == 0 and step.launch_mark_host == pytest.approx(0.0002)
