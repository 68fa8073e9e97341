"""Prompt-lookup (n-gram) proposer: model-free drafts copied from earlier in the sequence.

The longest suffix of the committed tokens (between prompt_lookup_max and prompt_lookup_min
tokens) that occurred before is matched, and the tokens that followed its most recent earlier
occurrence are proposed. Drafts are one-hot (q(d) = 1), which rejection sampling handles losslessly
for sampled requests too.
"""

from __future__ import annotations

import numpy as np
import torch

from specd.proposers.base import DraftProposal, DraftRequest
from specd.sampling_params import SamplingParams


def find_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens following the most recent earlier occurrence of the longest matching suffix.

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


class NgramProposer:
    """Per-sequence token history; no model, no hidden states."""

    method = "ngram"
    hidden_kind = "none"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("prompt_lookup_min: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._history: dict[int, list[int]] = {}
        self.draft_constraints = None  # DraftConstraints when structured output is enabled

    def open(self, seq_id: int, params: SamplingParams, grammar=None) -> None:
        self._history[seq_id] = []
        if self.draft_constraints is not None:
            self.draft_constraints.open(seq_id, grammar)

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        proposals = []
        for req in requests:
            history = self._history[req.seq_id]
            history.extend(req.new_token_ids)
            drafts = np.empty(0, dtype=np.int64)
            if req.num_draft_tokens > 0:
                drafts = find_ngram_continuation(np.asarray(history, dtype=np.int64), self.min_n,
                                                 self.max_n, req.num_draft_tokens)
                drafts = self._grammar_prefix(req, history, drafts)
            proposals.append(DraftProposal(token_ids=torch.from_numpy(drafts.copy())))
        return proposals

    def _grammar_prefix(self, req: DraftRequest, history: list[int], drafts: np.ndarray) -> np.ndarray:
        """The drafts a constrained sequence's grammar allows (a copied continuation may break it)."""
        dc = self.draft_constraints
        if dc is None or not dc.is_constrained(req.seq_id):
            return drafts
        dc.begin(req.seq_id, history[len(history) - req.num_output_tokens:])
        n = 0
        while n < drafts.size and dc.advance(req.seq_id, int(drafts[n])):
            n += 1
        return drafts[:n]

    def close(self, seq_id: int) -> None:
        self._history.pop(seq_id, None)
        if self.draft_constraints is not None:
            self.draft_constraints.close(seq_id)
