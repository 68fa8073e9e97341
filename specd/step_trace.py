"""A profiler trace of a window of a service's steps, as it serves (diagnosis only).

Verifier: SPECD_TRACE_STEPS=FIRST:COUNT traces the engine steps FIRST .. FIRST + COUNT - 1 of its
loop (from 0, busy steps only) into one Chrome trace, `SPECD_TRACE_DIR/trace.json.gz` (default:
the working directory). Drafter: SPECD_DRAFTER_TRACE_STEPS=FIRST:COUNT, its draft steps (every
stream's, in the order served), into `SPECD_TRACE_DIR/drafter_trace.json.gz`. Unset: nothing.

Why: the device clock (device_clock.py) says how long a verify forward took, not why; a late
launch, slower kernels or other kernels show only in a kernel-level trace of the services
themselves (bench/trace_summary.py reads it).

On CUDA the verifier records device activity only (kernels, copies and their runtime calls,
through CUPTI); the drafter records the host's ops too (its host work outside the proposer is what
its trace is for). CUPTI slows each launch (a graph's launch takes ~0.27 ms of host time while
traced), so a traced stack's tokens/s do not compare with an untraced one's; its kernels' times
do. On the CPU the host's ops are the only activity there is.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from specd import settings

log = logging.getLogger("specd.trace")

TRACE_FILE = "trace.json.gz"
DRAFTER_TRACE_FILE = "drafter_trace.json.gz"


@dataclass(frozen=True)
class TraceWindow:
    """Steps first .. first + count - 1, traced into out_dir/file_name (steps_env: the setting's name)."""

    first: int
    count: int
    out_dir: str
    file_name: str = TRACE_FILE
    steps_env: str = settings.TRACE_STEPS.name

    def __post_init__(self) -> None:
        if self.first < 0 or self.count < 1:
            raise ValueError(f"{self.steps_env}: expected FIRST:COUNT with FIRST >= 0 and COUNT >= 1, "
                             f"got {self.first}:{self.count}")

    @classmethod
    def parse(cls, text: str, out_dir: str = ".", file_name: str = TRACE_FILE,
              steps_env: str = settings.TRACE_STEPS.name) -> "TraceWindow | None":
        """FIRST:COUNT (or FIRST: one step); empty: None."""
        text = text.strip()
        if not text:
            return None
        first, sep, count = text.partition(":")
        try:
            first_step, num_steps = int(first), int(count) if sep else 1
        except ValueError:
            raise ValueError(f"{steps_env}: expected FIRST:COUNT (integers), got {text!r}") from None
        return cls(first_step, num_steps, out_dir, file_name, steps_env)

    @classmethod
    def from_settings(cls, steps: settings.Setting = settings.TRACE_STEPS,
                      file_name: str = TRACE_FILE) -> "TraceWindow | None":
        return cls.parse(steps.get(), settings.TRACE_DIR.get(), file_name, steps.name)


class StepTracer:
    """Wraps the loop's steps: `started` before each step, `done` after it. host_ops: record the
    host's ops on CUDA too (the CPU's are its only activity anyway)."""

    def __init__(self, window: TraceWindow, device: torch.device | None, host_ops: bool = False) -> None:
        self.window = window
        cuda = device is not None and device.type == "cuda"
        self._activities = ([torch.profiler.ProfilerActivity.CUDA] if cuda else []) + (
            [torch.profiler.ProfilerActivity.CPU] if host_ops or not cuda else [])
        self._profiler: torch.profiler.profile | None = None
        self.num_steps = 0  # steps seen
        self.path: str | None = None  # the trace, once written

    def started(self) -> None:
        if self.num_steps == self.window.first and self.path is None:
            self._profiler = torch.profiler.profile(activities=self._activities)
            self._profiler.start()

    def done(self) -> None:
        self.num_steps += 1
        if self._profiler is not None and self.num_steps == self.window.first + self.window.count:
            self._write()

    def close(self) -> None:
        """The loop ends inside the window: what was traced is still written."""
        if self._profiler is not None:
            self._write()

    def _write(self) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        t0 = time.perf_counter()
        os.makedirs(self.window.out_dir, exist_ok=True)
        path = os.path.join(self.window.out_dir, self.window.file_name)
        profiler.export_chrome_trace(path)  # gzip-compressed: the name ends in .gz
        self.path = path
        log.info("step trace written", extra={"path": path, "steps": self.num_steps - self.window.first,
                                              "export_s": round(time.perf_counter() - t0, 2)})
