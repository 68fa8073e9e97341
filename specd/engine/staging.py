"""The next verify batch, staged in the runner while its drafts are out.

Why: the engine waits for the drafters anyway; the runner can do the batch's host work meanwhile
(slots reserved, the static path's buffers filled, LlamaRunner.stage), and the step's launch is
then the draft ids' write and the replay. Exact: the staged k are the planned ones the next step
uses (SpecEngine._num_drafts, unchanged unless the cache changes, which undoes the stage); the
runner undoes a stage on any other call, and drafts that come back shorter refill it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from specd.engine.sequence import Sequence
from specd.models.base import SequenceChunk

# "1": the verify batch staged while drafts are out; "late": staged when the engine's owner says
# so (SpecEngine.stage_next_verify), after the verifier hands its result flush to the writer
# thread. Off ("0") by default since run 56, where the staged stacks lost at batch 1 (H100:
# 2.30-2.40x of off against 2.52x unstaged). The cause was not staging itself: the stage
# captured its layouts' graphs without the runner's kernel settings (cuBLAS, no PDL), ~0.37 ms a
# forward; fixed in LlamaRunner.stage. With the fix (BENCHMARKS.md, runs 61-62, H100) staging
# gained 2.6% at batch 1 and lost 14% at batch 128 (its host work and the draft sender contend
# for the GIL), both within the stacks' noise: off stays the default until an H200 A/B decides.
STAGE_VERIFY_ENV = "SPECD_STAGE_VERIFY"


class VerifyStaging:
    """Whether the runner holds the batch staged for this step (a runner without `stage`, or
    SPECD_STAGE_VERIFY unset or 0: never)."""

    def __init__(self, runner) -> None:
        mode = os.environ.get(STAGE_VERIFY_ENV, "0")
        self._runner = runner
        self._stage = getattr(runner, "stage", None) if mode != "0" else None
        self._staged = False
        self.late = mode == "late"  # staged on the owner's call, not at the step's end

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
