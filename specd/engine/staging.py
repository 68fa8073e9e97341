"""The next verify batch, staged in the runner while its drafts are out.

Why: the engine waits for the drafters anyway; the runner can do the batch's host work meanwhile
(slots reserved, the static path's buffers filled, LlamaRunner.stage), and the step's launch is
then the draft ids' write and the replay. Exact: the staged k are the planned ones the next step
uses (SpecEngine._num_drafts, unchanged unless the cache changes, which undoes the stage); the
runner undoes a stage on any other call, and drafts that come back shorter refill it.
"""

from __future__ import annotations

from collections.abc import Callable

from specd import settings
from specd.engine.sequence import Sequence
from specd.models.base import SequenceChunk

# SPECD_STAGE_VERIFY (on by default): the verify batch staged at a step's end while its drafts are
# out. On the GPU a staged step launches its forward sooner after the step starts, more so at large
# batches (BENCHMARKS.md, "Staged verify batch (CPU)").


class VerifyStaging:
    """Whether the runner holds the batch staged for this step (a runner without `stage`, i.e.
    one off the static path, or SPECD_STAGE_VERIFY=0: never)."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self._stage = getattr(runner, "stage", None) if settings.STAGE_VERIFY.get() else None
        self._staged = False

    def stage_next(self, running: list[Sequence], num_drafts: Callable[[Sequence], int], *,
                   drafts_out: bool, admission_due: bool, want_aux_hidden: bool) -> None:
        """At a step's end: stage the next verify batch, only where drafts are out (the engine
        would wait for them) and no admission is due (its prefill would undo the stage)."""
        self._staged = False
        if self._stage is None or not drafts_out or admission_due or not running:
            return
        chunks = [SequenceChunk(s.seq_id, [s.last_token_id] * (1 + num_drafts(s))) for s in running]
        self._staged = self._stage(chunks, want_aux_hidden=want_aux_hidden)

    def holds(self) -> bool:
        """Whether the staged batch is still in the runner (an admission, abort or preemption
        since undid it). A held batch has every sequence's room reserved."""
        self._staged = self._staged and self._runner.staged
        return self._staged

    def taken(self) -> bool:
        """The verify forward takes the staged batch, or undoes it; returns whether one was held."""
        held, self._staged = self.holds(), False
        return held
