"""A verify step on the device's own clock.

The host sees a step as verify (its host work, the forward queued early in it) and then the
commit's device wait, ending when the results reach it. That sum mixes the device's work with the
host's wake-up after it: the two staged / unstaged variants of BENCHMARKS.md's runs 48-49 spent
0.27 ms a step more in verify + device wait at batch 1 with the same graphs, and the host clock
cannot say which. Events recorded at the step's start, after its forward is queued and after its
sampling is, read after the step's one sync: the device's time to the forward's end and to the
step's end; the host's verify + device wait less the latter is the wake-up (and the results' copy).

On CUDA the events are CUDA events (each record a few us of host time, no sync); elsewhere the
"device" is the host itself, and HostEvent stands in, timing the same points on the host's clock.
"""

from __future__ import annotations

import time

import torch


class HostEvent:
    """torch.cuda.Event's record / elapsed_time on the host clock (a CPU device runs in line)."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.t - self.t) * 1e3  # ms, as CUDA events answer


class DeviceClock:
    """Three marks of one verify step (start, forward queued, step queued); `read` after the
    step's sync returns (seconds to the forward's end, seconds to the step's end) on the device's
    clock, both from the start mark, or None when no step was marked since the last read."""

    def __init__(self, device: torch.device) -> None:
        make = ((lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else HostEvent)
        self._start, self._forward, self._step = make(), make(), make()
        self._marked = False

    def start(self) -> None:
        self._start.record()

    def forward_queued(self) -> None:
        self._forward.record()

    def step_queued(self) -> None:
        self._step.record()
        self._marked = True

    def read(self) -> tuple[float, float] | None:
        """Only after the step's sync (CUDA events must have completed)."""
        if not self._marked:
            return None
        self._marked = False
        return self._start.elapsed_time(self._forward) / 1e3, self._start.elapsed_time(self._step) / 1e3
