"""Run a proposer through two drafting steps on a throwaway sequence before it serves.

Why: a proposer's first steps pay one-time costs: cuBLAS and kernel initialisation, the KV pools
of the EAGLE-3 / MTP heads (allocated at their first forward), and the CUDA graphs of the first
layouts (draft_model's runner captures every prefill layout at its first prompt). On a GPU that
first step took longer than the verifier's drafter deadline (2 s by default), so the verifier
parked the drafter's sequences and decoded them target-only until it reconnected. Warmed up at
load, the drafter reports SERVING only once those costs are paid.

The two steps are the shapes serving starts with at batch 1: a prompt (Q = prompt_len) followed
by k single-token steps, then a catch-up of k + 1 committed tokens (a fully accepted step).
Token ids and hidden rows are zeros; the sequence is closed afterwards, which frees its caches.
"""

from __future__ import annotations

import logging
import time

import torch

from specd.proposers.base import DraftRequest, Proposer
from specd.sampling_params import SamplingParams

log = logging.getLogger(__name__)

WARM_UP_SEQ_ID = -1  # never a served id: the drafter's internal ids count up from 0
# Host-only proposers: nothing to initialise (and replay would count the sequence as diverged).
NOTHING_TO_WARM = frozenset({"ngram", "replay"})


def warm_up(proposer: Proposer, *, hidden_width: int, num_draft_tokens: int, prompt_len: int = 16) -> float:
    """Two greedy drafting steps on sequence WARM_UP_SEQ_ID, then close it; returns the seconds
    (0.0 for the NOTHING_TO_WARM methods, which it leaves alone).

    hidden_width: the width H* of the target rows the proposer takes (ignored where its
    hidden_kind is "none"). num_draft_tokens: k of both steps (>= 1).
    """
    if num_draft_tokens < 1 or prompt_len < 1:
        raise ValueError(f"warm_up: need num_draft_tokens >= 1 and prompt_len >= 1, got "
                         f"{num_draft_tokens}, {prompt_len}")
    if proposer.method in NOTHING_TO_WARM:
        return 0.0
    takes_rows = proposer.hidden_kind != "none"
    if takes_rows and hidden_width < 1:
        raise ValueError(f"warm_up: a {proposer.method} proposer takes hidden rows; hidden_width must be >= 1")

    def request(num_tokens: int, num_rows: int, num_output_tokens: int) -> DraftRequest:
        rows = torch.zeros(num_rows, hidden_width) if takes_rows else None
        return DraftRequest(WARM_UP_SEQ_ID, [0] * num_tokens, rows, num_draft_tokens,
                            num_output_tokens=num_output_tokens)

    t0 = time.perf_counter()
    proposer.open(WARM_UP_SEQ_ID, SamplingParams(max_new_tokens=4 * num_draft_tokens + 4))
    try:
        # Step 1: prompt + first token, one hidden row fewer than tokens (base.py's alignment).
        proposer.propose([request(prompt_len + 1, prompt_len, 1)])
        # Step 2: every draft accepted plus the bonus token.
        proposer.propose([request(num_draft_tokens + 1, num_draft_tokens + 1, num_draft_tokens + 2)])
    finally:
        proposer.close(WARM_UP_SEQ_ID)
    seconds = time.perf_counter() - t0
    log.info("event=proposer_warm_up method=%s k=%d seconds=%.3f", proposer.method, num_draft_tokens, seconds)
    return seconds
