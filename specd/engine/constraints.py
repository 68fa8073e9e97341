"""Structured output inside the engine step: one grammar exchange per step for the whole batch.

The grammar backend holds the real matcher of each constrained sequence. Each step sends the
tokens committed by the previous step (they advance the real matchers) together with this step's
draft tokens (masks are computed along them on forks); the masks then restrict the target's logits
at positions 0..k serially along the drafts, so speculative output equals constrained target-only
decoding token for token, and only accepted tokens ever reach the real matcher.
"""

from __future__ import annotations

import time

import torch

from specd.engine.sequence import Sequence
from specd.grammar.backend import GrammarBackend, GrammarStep, MaskResult


class ConstraintTracker:
    """Which sequences are constrained, what their matchers have not seen yet, and their masks."""

    def __init__(self, backend: GrammarBackend | None) -> None:
        self.backend = backend
        self._pending: dict[int, list[int]] = {}  # seq_id -> committed tokens not yet sent
        self.seconds = 0.0  # time spent in grammar exchanges (for the step-time split)

    def is_constrained(self, seq: Sequence) -> bool:
        return seq.grammar is not None

    def open(self, seq: Sequence) -> None:
        """Start (or, for a resumed sequence, rebuild by replay) the sequence's matcher."""
        if seq.grammar is None:
            return
        if self.backend is None:
            raise ValueError("response_format: this engine has no grammar backend")
        self.backend.open(seq.seq_id, seq.grammar, replay_token_ids=list(seq.output_token_ids))
        self._pending[seq.seq_id] = []

    def committed(self, seq: Sequence, tokens: list[int]) -> None:
        if seq.seq_id in self._pending:
            self._pending[seq.seq_id].extend(tokens)

    def close(self, seq: Sequence) -> None:
        if self._pending.pop(seq.seq_id, None) is not None:
            self.backend.close(seq.seq_id)

    def masks(self, seqs: list[Sequence], drafts: list[list[int]]) -> list[MaskResult | None]:
        """One exchange: commit what each constrained sequence accepted, mask along its drafts."""
        constrained = [(s, d) for s, d in zip(seqs, drafts) if s.seq_id in self._pending]
        if not constrained:
            return [None] * len(seqs)
        t0 = time.perf_counter()
        step = GrammarStep(commits={s.seq_id: self._pending[s.seq_id] for s, _ in constrained},
                           drafts={s.seq_id: list(d) for s, d in constrained})
        results = self.backend.step(step)
        for s, _ in constrained:
            self._pending[s.seq_id] = []
        self.seconds += time.perf_counter() - t0
        return [results.get(s.seq_id) if s.seq_id in self._pending else None for s in seqs]


def mask_rows(logits: torch.Tensor, row_offsets: list[int], masks: list[MaskResult | None]) -> torch.Tensor:
    """Apply each request's bitmask rows to its logits rows.

    logits: [num_rows, V]; request i's rows start at row_offsets[i]; its mask rows cover the first
    num_valid_drafts + 1 of them (later rows follow a draft the grammar forbids and are never read).
    """
    if all(m is None for m in masks):
        return logits
    from specd.grammar.masking import apply_bitmask  # only constrained batches pay for xgrammar

    logits = logits.clone()
    for start, m in zip(row_offsets, masks):
        if m is None:
            continue
        n = m.bitmask.shape[0]
        logits[start:start + n] = apply_bitmask(logits[start:start + n], m.bitmask.to(logits.device))
    return logits
