"""A verify step on the device's clock (specd/engine/device_clock.py): the marks, and the engine's
running totals from them. On CPU the device is the host (HostEvent): the same code paths, timed on
the host clock; on CUDA the same marks are CUDA events (the e2e bench prints both on the GPU)."""

from __future__ import annotations

import time

import torch

from specd.engine.builder import build_engine
from specd.engine.device_clock import DeviceClock
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from tests.engine.test_greedy_lossless import make_requests


def test_marks_read_once_after_a_marked_step():
    clock = DeviceClock(torch.device("cpu"))
    assert clock.read() is None  # nothing marked yet
    clock.start()
    time.sleep(0.002)
    clock.forward_queued()
    time.sleep(0.003)
    clock.step_queued()
    forward, step = clock.read()
    assert 0.002 <= forward < step and step - forward >= 0.003
    assert clock.read() is None  # read once: a step without marks adds nothing


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
    assert 0 < t.device_forward < t.device_step <= t.verify + t.device_wait
    assert t.device_step > 0.5 * t.verify  # the forward is most of verify on CPU
