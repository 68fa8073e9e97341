"""Prompt-lookup (n-gram) proposer: model-free drafts copied from earlier in the sequence.

The longest suffix of the committed tokens (between prompt_lookup_max and prompt_lookup_min
tokens) that occurred before is matched, and the tokens that followed its most recent earlier
occurrence are proposed. Drafts are one-hot (q(d) = 1), which rejection sampling handles losslessly
for sampled requests too.
"""

from __future__ import annotations

import numpy as np

from specd.proposers.base import DraftProposal, DraftRequest, greedy_proposals
from specd.sampling_params import SamplingParams


def find_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens following the most recent earlier occurrence of the longest matching suffix.
    The definition, as a scan of the whole history; the proposer keeps an NgramIndex instead.

    tokens: [L] int64. Returns [<= k] int64 (empty when no suffix of length >= min_n recurs).
    """
    assert tokens.ndim == 1
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows[i] = tokens[i:i+n] for starts i that leave at least one token after the window
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < length]  # the suffix itself is not a match
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return tokens[:0]


class NgramIndex:
    """One sequence's tokens and, per n in [min_n, max_n], where each n-gram last occurred with a
    token after it: find_ngram_continuation's answer by a few dictionary lookups.

    Why: find_ngram_continuation scans the whole history on every call, O(L * n) in numpy calls
    whose fixed cost dominates: ~0.1 ms a sequence, so 10-16 ms a step at batch 128 (H200), which
    made n-gram speculation slower than none there (BENCHMARKS.md, "Drafter host time (CPU)", has
    the scan against the index). Here a new token costs max_n - min_n + 1 dictionary writes and a
    lookup at most max_n - min_n + 1 reads.

    An n-gram occupying [i, i + n) is entered once the token at i + n exists (a continuation to
    copy), keyed by its tokens, valued i + n; a later occurrence overwrites it (the most recent
    wins), and the history's own suffix is never a match for itself (its continuation is not there yet).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]

    def extend(self, new_tokens) -> None:
        tokens = self.tokens
        for t in new_tokens:
            p = len(tokens)  # t's position: the n-grams ending at p - 1 now have a continuation
            for n in range(self.min_n, min(self.max_n, p) + 1):
                self._after[n - self.min_n][tuple(tokens[p - n:p])] = p
            tokens.append(int(t))

    def continuation(self, k: int) -> list[int]:
        """Up to k tokens after the most recent earlier occurrence of the longest matching suffix."""
        tokens = self.tokens
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._after[n - self.min_n].get(tuple(tokens[length - n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class NgramProposer:
    """Per-sequence token history; no model, no hidden states."""

    method = "ngram"
    hidden_kind = "none"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("prompt_lookup_min: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._indexes: dict[int, NgramIndex] = {}
        self.draft_constraints = None  # DraftConstraints when structured output is enabled

    def open(self, seq_id: int, params: SamplingParams, grammar=None) -> None:
        self._indexes[seq_id] = NgramIndex(self.min_n, self.max_n)
        if self.draft_constraints is not None:
            self.draft_constraints.open(seq_id, grammar)

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        drafts: list[list[int]] = []
        for req in requests:
            index = self._indexes[req.seq_id]
            index.extend(req.new_token_ids)
            drafts.append(self._grammar_prefix(req, index.tokens, index.continuation(req.num_draft_tokens))
                          if req.num_draft_tokens > 0 else [])
        return greedy_proposals(drafts)

    def _grammar_prefix(self, req: DraftRequest, history: list[int], drafts: list[int]) -> list[int]:
        """The drafts a constrained sequence's grammar allows (a copied continuation may break it)."""
        dc = self.draft_constraints
        if dc is None or not dc.is_constrained(req.seq_id):
            return drafts
        dc.begin(req.seq_id, history[len(history) - req.num_output_tokens:])
        n = 0
        while n < len(drafts) and dc.advance(req.seq_id, drafts[n]):
            n += 1
        return drafts[:n]

    def close(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)
        if self.draft_constraints is not None:
            self.draft_constraints.close(seq_id)
