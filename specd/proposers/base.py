"""The drafter contract: per-request draft state, fed the committed tokens, proposing k tokens.

A proposer only ever sees committed tokens: the tokens the verifier accepted (plus the recovered
or bonus token). Its own speculative state (draft KV entries past the committed prefix) is rolled
back by the proposer itself when the next committed tokens arrive.

Alignment of target hidden states: a sequence whose committed tokens are x_0..x_n has been run
through the target up to x_{n-1}; the target hidden state h_p belongs to position p, so the
proposer always holds one hidden row fewer than tokens. EAGLE-3 and MTP heads pair (h_p, x_{p+1})
at position p to predict x_{p+2}.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch

from specd.grammar.backend import GrammarSpec
from specd.sampling_params import SamplingParams

HiddenKind = Literal["none", "final", "aux"]


@dataclass
class DraftRequest:
    """One sequence's input to a drafting step."""

    seq_id: int
    new_token_ids: list[int]  # committed since the last step (first step: prompt + first token)
    new_hidden_states: torch.Tensor | None  # [len(new_token_ids) - (1 on first step else 0), H*]
    num_draft_tokens: int  # k for this sequence in this step (0: propose nothing, still ingest)
    num_output_tokens: int = 0  # committed output tokens so far (the tail of the history): what a
    # constrained sequence's grammar has seen


def hidden_rows_to_host(requests: list[DraftRequest], dtype: torch.dtype | None = None) -> list[DraftRequest]:
    """The requests with their hidden rows on the host (as `dtype` when given), through one
    device-to-host copy for the whole batch where the rows are alike (2-D, one width, one device).

    Why: a copy per request waits for the device each time, and the engine sends a step's
    requests right after a commit: 128 waits a step at batch 128, for EAGLE-3 rows of 3 x 4096
    a token.
    """
    given = [r.new_hidden_states for r in requests if r.new_hidden_states is not None]
    if not given or any(t.ndim != 2 for t in given) or len({(t.shape[1], t.device, t.dtype) for t in given}) != 1:
        return requests
    rows = torch.cat(given).to(dtype or given[0].dtype)
    if rows.is_cuda:  # into pinned memory: a pageable copy is staged by the driver, ~1.3 GB/s here
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        torch.cuda.current_stream(rows.device).synchronize()
        rows = host
    host = iter(rows.split([t.shape[0] for t in given]))
    return [r if r.new_hidden_states is None else replace(r, new_hidden_states=next(host))
            for r in requests]


@dataclass
class DraftProposal:
    """Draft tokens for one sequence, with the draft distribution when drafts were sampled."""

    token_ids: torch.Tensor  # [k] int64, target-vocabulary ids
    probs: torch.Tensor | None = None  # [k, target_vocab] float32 q; None: one-hot (greedy) drafts

    def truncated(self, k: int) -> "DraftProposal":
        """The first k drafts (a prefix of drafts is a valid proposal: verifying fewer changes no
        output, and the drafter learns what was kept from the next step's tokens)."""
        if self.token_ids.numel() <= k:
            return self
        return DraftProposal(self.token_ids[:k], None if self.probs is None else self.probs[:k])


def greedy_proposals(drafts: list[list[int]]) -> list[DraftProposal]:
    """One one-hot proposal per list of draft ids, each a view of one int64 tensor. Why: a tensor
    per sequence costs ~3 us, a view ~1.5 (a batch of 128 lookups spent ~0.4 ms on them)."""
    if len(drafts) <= 1:  # (a split of one costs more than it saves)
        return [DraftProposal(torch.tensor(d, dtype=torch.long)) for d in drafts]
    ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    return [DraftProposal(view) for view in ids.split([len(d) for d in drafts])]


class Proposer(Protocol):
    """Draft proposer holding each request's draft state (draft KV cache, n-gram index)."""

    method: str
    hidden_kind: HiddenKind  # which target hidden states the proposer consumes
    # Draft masking for constrained sequences (specd.proposers.draft_constraints); None: drafts are
    # unconstrained and the verifier's masks alone keep the output valid.
    draft_constraints: object | None

    def open(self, seq_id: int, params: SamplingParams, grammar: GrammarSpec | None = None) -> None:
        """Start draft state for a sequence (masking its drafts by the grammar when given)."""

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """Ingest each request's committed tokens, then propose its draft tokens (batched)."""

    def close(self, seq_id: int) -> None:
        """Drop the sequence's draft state."""
