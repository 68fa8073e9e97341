"""Structured output inside the engine step: one grammar exchange per step for the whole batch.

The grammar backend holds the real matcher of each constrained sequence. Each step sends the
tokens committed by the previous step (they advance the real matchers) together with this step's
draft tokens (masks are computed along them on forks); the masks then restrict the target's logits
at positions 0..k serially along the drafts, so speculative output equals constrained target-only
decoding token for token, and only accepted tokens ever reach the real matcher.

Each step also sends every sequence's budget (the tokens it may still emit), so that near the end
of max_tokens or of the context the masks close the output (specd/grammar/budget.py): a
constrained response then ends complete and valid, with finish_reason "stop", instead of being cut
off mid-value. A row depends only on the tokens before it and the budget there, so closing keeps
speculative output equal to target-only output.
"""

from __future__ import annotations

import time

import torch

from specd.clients.errors import GrammarServiceError
from specd.engine.sequence import Sequence
from specd.grammar.backend import GrammarBackend, GrammarStep, MaskResult


class ConstraintTracker:
    """Which sequences are constrained, what their matchers have not seen yet, and their masks."""

    def __init__(self, backend: GrammarBackend | None, max_model_len: int | None = None) -> None:
        self.backend = backend
        self.max_model_len = max_model_len  # None: only max_new_tokens bounds a sequence
        self._pending: dict[int, list[int]] = {}  # seq_id -> committed tokens not yet sent
        self._closing_rows: dict[int, int] = {}  # seq_id -> first row of its last masks closing changed
        self.seconds = 0.0  # time spent in grammar exchanges (for the step-time split)
        self.num_closed_sequences = 0  # sequences whose output budget-aware closing shaped
        # seq id -> why: constrained sequences whose matchers the backend lost for good (the grammar
        # service down past its recovery time, or it refused them); the engine fails them alone.
        self.failed: dict[int, str] = {}

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

    def budget(self, seq: Sequence) -> int | None:
        """Tokens seq may still emit, its stop token included; None while min_new_tokens holds the
        stop tokens back (a forced stop token would be masked out: no closing before then)."""
        if seq.num_output_tokens < seq.params.min_new_tokens:
            return None
        left = seq.params.max_new_tokens - seq.num_output_tokens
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - seq.num_tokens)
        return max(1, left)

    def committed(self, seq: Sequence, tokens: list[int]) -> None:
        """tokens, emitted from rows 0.. of the last masks, were appended to seq."""
        if seq.seq_id not in self._pending:
            return
        self._pending[seq.seq_id].extend(tokens)
        first_closing = self._closing_rows.pop(seq.seq_id, None)
        if first_closing is not None and len(tokens) > first_closing:
            if seq.num_closing_tokens == 0:
                self.num_closed_sequences += 1
            seq.num_closing_tokens += len(tokens) - first_closing

    def close(self, seq: Sequence) -> None:
        self._closing_rows.pop(seq.seq_id, None)
        if self._pending.pop(seq.seq_id, None) is not None:
            self.backend.close(seq.seq_id)

    def masks(self, seqs: list[Sequence], drafts: list[list[int]]) -> list[MaskResult | None]:
        """One exchange: commit what each constrained sequence accepted, mask along its drafts."""
        constrained = [(s, d) for s, d in zip(seqs, drafts) if s.seq_id in self._pending]
        if not constrained:
            return [None] * len(seqs)
        t0 = time.perf_counter()
        budgets = {s.seq_id: self.budget(s) for s, _ in constrained}
        step = GrammarStep(commits={s.seq_id: self._pending[s.seq_id] for s, _ in constrained},
                           drafts={s.seq_id: list(d) for s, d in constrained},
                           budgets={seq_id: b for seq_id, b in budgets.items() if b is not None})
        try:
            results = self.backend.step(step)
        except GrammarServiceError as err:
            # Only the constrained requests fail (they cannot go on unmasked); the rest of the
            # batch goes on. The backend forgot every matcher: these are all the tracked ones.
            for s, _ in constrained:
                self.failed[s.seq_id] = f"structured output: {err}"
                self._pending.pop(s.seq_id, None)
                self._closing_rows.pop(s.seq_id, None)
            self.seconds += time.perf_counter() - t0
            return [None] * len(seqs)
        for s, _ in constrained:
            self._pending[s.seq_id] = []
            result = results.get(s.seq_id)
            if result is not None and result.num_closing_rows:
                self._closing_rows[s.seq_id] = result.bitmask.shape[0] - result.num_closing_rows
            else:
                self._closing_rows.pop(s.seq_id, None)
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


def keep_grammar_rows(grammar_logits: torch.Tensor, suppressed: torch.Tensor) -> torch.Tensor:
    """Rows that min_new_tokens' stop suppression emptied keep the grammar's own row.

    A row is all -inf after both only where the grammar allows nothing but stop tokens, i.e. the
    constrained output is complete: the grammar wins over min_new_tokens (an all -inf row would
    turn the probabilities into NaN). Both [rows, V]; no host synchronisation.
    """
    emptied = torch.isneginf(suppressed).all(dim=-1, keepdim=True)  # [rows, 1]
    return torch.where(emptied, grammar_logits, suppressed)
