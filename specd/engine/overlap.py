"""Overlapped decoding: step N+1's forward is queued before step N's tokens reach the host.

Without speculation a decode step's only input the host lacks is the token step N sampled, and
that token is on the device already: the next forward reads it there (the runner's
first_token_ids), the host queues it right behind step N's sampling, and only then waits for step
N's tokens, to append them, check stops and hand them to the emitter while the device runs step
N+1. The host's commit, emission, admission and Redis round trips leave the device's critical path.

What the host cannot know at launch costs at most one step of discarded work: a sequence whose
step-N token stops it (EOS, a stop word) was decoded once more in step N+1, and that row is
dropped when step N+1 lands. Sequences whose step-N token is their last by length are known to
stop and are left out. Output is identical to the synchronous loop: the same tokens from the same
logits, sampled at the same positions with the same seeds.

A step overlaps only where every sequence's next input is that one token (`decode_ahead_blocks`):
speculation (drafts come from the host), grammars, repetition penalties and pending min_new_tokens
(which read the host's token history), requests that ask for logprobs (read at a synchronous
commit; specd/engine/logprobs.py), a full cache (preemption decides on landed state) and
runners without first_token_ids take the synchronous step, after the step in flight has landed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.engine.device_clock import DeviceClock
from specd.engine.sequence import Sequence
from specd.engine.stop import StopChecker
from specd.models.append_plan import AppendPlan
from specd.proposers.base import DraftProposal


@dataclass
class StepInFlight:
    """A decode step queued on the device whose tokens the host has not read yet."""

    batch: list[Sequence]
    rows: dict[int, int]  # seq id -> its row in batch
    token_ids: torch.Tensor  # [B] int64 on the device: each row's sampled token
    landing: "HostRows"  # [B] the same tokens on their way to the host
    clock: DeviceClock  # this step's marks on the device's clock
    proposals: list[DraftProposal]  # none drafted: what commit reads k from

    def carried_rows(self, batch: list[Sequence]) -> list[int]:
        """Per sequence of the next batch: its row here (its next input is that row's token), or -1
        (a sequence admitted since: the host has its last token)."""
        return [self.rows.get(s.seq_id, -1) for s in batch]


class HostRows:
    """One device-to-host copy queued now and read later: on CUDA into pinned memory with an event
    behind it, so reading waits for this copy only, not for work queued after it (a plain
    .tolist() would wait for the next step's forward too)."""

    def __init__(self, values: torch.Tensor, pinned: torch.Tensor | None) -> None:
        """values: [N] int64 on the device; pinned: a pinned [>= N] host buffer (CUDA), else None."""
        self._event = None
        if pinned is None:
            self._values = values
            return
        self._values = pinned[:values.numel()]
        self._values.copy_(values, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._values.tolist()


class PinnedRing:
    """Pinned host buffers taken in turn: a step's landing copy must not be overwritten by the next
    step's before the host has read it (two steps are in flight at most)."""

    def __init__(self, device: torch.device, size: int, count: int = 3) -> None:
        self._buffers = ([torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(count)]
                         if device.type == "cuda" else [])
        self._next = 0

    def take(self) -> torch.Tensor | None:
        if not self._buffers:
            return None
        self._next = (self._next + 1) % len(self._buffers)
        return self._buffers[self._next]


def decode_ahead_blocks(seq: Sequence) -> bool:
    """Whether seq's next step needs its tokens on the host (its history or the output length):
    a grammar's mask, a penalty over the tokens so far, or min_new_tokens not reached yet; or
    whether it asks for logprobs, which the synchronous commit reads (the landing copy holds tokens
    only)."""
    params = seq.params
    return (seq.grammar is not None or params.needs_output_history
            or params.min_new_tokens > seq.num_output_tokens or params.logprobs is not None)


def next_decode_batch(running: list[Sequence], flight: StepInFlight, plan: AppendPlan,
                      stop: StopChecker) -> list[Sequence] | None:
    """The sequences whose next decode step may be queued before `flight` lands, or None where the
    step must wait for it (some sequence needs its host state, or the cache has no room for one
    more token each: preemption decides on landed state). Sequences that stop by length when the
    flight lands are left out."""
    # With a block free for every sequence (the usual case) no claim can fail: skip the claims,
    # ~4 us a sequence (as drafting.plan_draft_lengths does).
    roomy = plan.fits_everyone(len(running), 1) and (plan.session_len is None
                                                     or plan.session_len >= stop.max_model_len)
    batch = []
    for seq in running:
        if seq.is_finished:
            continue
        pending = 1 if seq.seq_id in flight.rows else 0
        if seq.num_output_tokens + pending >= stop.max_output(seq):  # it stops when the flight lands
            continue
        if decode_ahead_blocks(seq) or not (roomy or plan.take(seq.seq_id, 1)):
            return None
        batch.append(seq)
    return batch
