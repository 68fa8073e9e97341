"""A verify step on the device's own clock.

The host sees a step as verify (its host work, the forward queued early in it) and then the
commit's device wait, ending when the results reach it. That sum mixes the device's work with the
host's wake-up after it: a staged and an unstaged stack have differed by 0.27 ms a step in
verify + device wait at batch 1 with the same graphs, and the host clock cannot say which.

Events are recorded at the step's start, right before the forward's first device work (the
runner calls `launching`: the graph's replay), after the forward is queued and after the sampling
is, and read after the step's one sync: the device's time to the launch, to the forward's end and
to the step's end. The host's verify + device wait less the latter is the wake-up (and the
results' copy); the forward's end less the launch is the forward's own device time.

On CUDA the events are CUDA events (each record a few us of host time, no sync); elsewhere the
"device" is the host itself, and HostEvent stands in, timing the same points on the host's clock.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch


class HostEvent:
    """torch.cuda.Event's record / elapsed_time on the host clock (a CPU device runs in line)."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.t - self.t) * 1e3  # ms, as CUDA events answer


class DeviceMarks(NamedTuple):
    """Seconds on the device's clock from a verify step's start."""

    launch: float | None  # to the forward's first device work; None where the runner did not mark it
    forward: float  # to the forward's end
    step: float  # to the sampling's end
    # Host seconds inside the launch mark's record: the event is queued at once, but the call
    # gives up the GIL and takes it back, so another thread's turn (the result writer's) right
    # before the forward's launch lands here and, on the device's clock, in the forward.
    launch_mark_host: float = 0.0
    staged: bool = False  # whether the forward took a batch staged while its drafts were out


class DeviceClock:
    """Four marks of one verify step (start, launching, forward queued, step queued); `read`
    after the step's sync returns their DeviceMarks, or None when no step was marked since the
    last read."""

    def __init__(self, device: torch.device) -> None:
        make = ((lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else HostEvent)
        self._start, self._launch, self._forward, self._step = make(), make(), make(), make()
        self._marked = False
        self._launched = False  # since the last start (a prefill's forward marks it too: ignored)
        self._launch_mark_host = 0.0
        self._staged = False

    def start(self) -> None:
        self._start.record()
        self._launched = False
        self._launch_mark_host = 0.0

    def launching(self) -> None:
        """The runner's hook, right before the forward's device work (after its host work)."""
        t0 = time.perf_counter()
        self._launch.record()
        self._launch_mark_host = time.perf_counter() - t0
        self._launched = True

    def forward_queued(self, staged: bool = False) -> None:
        self._forward.record()
        self._staged = staged

    def step_queued(self) -> None:
        self._step.record()
        self._marked = True

    def read(self) -> DeviceMarks | None:
        """Only after the step's sync (CUDA events must have completed)."""
        if not self._marked:
            return None
        self._marked = False
        launch = self._start.elapsed_time(self._launch) / 1e3 if self._launched else None
        return DeviceMarks(launch, self._start.elapsed_time(self._forward) / 1e3,
                           self._start.elapsed_time(self._step) / 1e3,
                           self._launch_mark_host if self._launched else 0.0, self._staged)
