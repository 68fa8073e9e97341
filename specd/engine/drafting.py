"""The draft verb of an engine step, and drafting ahead.

Each step asks the proposer for k_i drafts per sequence in one batched call, handing it the tokens
(and hidden rows) committed since its last call. With a proposer that answers asynchronously (the
remote drafters: RemoteProposer.propose_async), the next step's requests leave right after each
commit instead (`send_ahead`) and the step collects them first thing (`collect`): the drafters
draft while the verifier writes results and admits, and the round trip leaves the critical path.

Lossless as ever: drafts are proposals, whatever their timing. The requests sent ahead carry
exactly what the next step would send; what changes in between is settled in `draft`: a sequence
that left the batch (finished, aborted, preempted) drops its drafts, one given tokens anew (an
admission, a resync) is asked in the step itself, and drafts are cut to the k that fits now
(admissions may have taken the cache room they assumed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specd.engine.sequence import Sequence
from specd.proposers.base import DraftProposal, DraftRequest, Proposer


class Drafting:
    """Draft requests of one engine: asked in the step, or sent ahead (see the module doc)."""

    def __init__(self, proposer: Proposer | None, num_drafts: Callable[[Sequence], int], ahead: bool) -> None:
        self.proposer = proposer
        self.num_drafts = num_drafts  # k for a sequence now (the engine's budget and cache room)
        self.ahead = ahead
        self._sent: tuple[list[DraftRequest], object] | None = None  # requests, their pending answer

    def request(self, seq: Sequence) -> DraftRequest:
        """What the drafter has not seen of seq (taken from it), and the k it may draft."""
        tokens, hidden = seq.take_undrafted()
        return DraftRequest(seq.seq_id, tokens, hidden, self.num_drafts(seq), num_output_tokens=seq.num_output_tokens)

    def send_ahead(self, batch: list[Sequence]) -> None:
        """Right after a commit: the next step's requests of `batch` go out now, where the
        proposer answers asynchronously and drafting ahead is on."""
        submit = getattr(self.proposer, "propose_async", None) if self.ahead else None
        if submit is None or not batch:
            return
        requests = [self.request(seq) for seq in batch]
        self._sent = (requests, submit(requests))

    def collect(self) -> dict[int, DraftProposal]:
        """The drafts sent ahead by the last step, by sequence id (empty when none were)."""
        if self._sent is None:
            return {}
        (requests, pending), self._sent = self._sent, None
        proposals = pending.result()
        _check(requests, proposals)
        return {req.seq_id: p for req, p in zip(requests, proposals)}

    def draft(self, batch: list[Sequence], sent_ahead: dict[int, DraftProposal]) -> list[DraftProposal]:
        """k_i drafts per sequence of batch: the ones sent ahead where they still apply, the rest
        from one batched proposer call."""
        if self.proposer is None or not batch:
            return [DraftProposal(torch.empty(0, dtype=torch.long)) for _ in batch]
        proposals: list[DraftProposal | None] = [None] * len(batch)
        fresh: list[int] = []
        for i, seq in enumerate(batch):
            early = sent_ahead.get(seq.seq_id)
            if early is None or seq.undrafted_token_ids:  # tokens the drafter has not seen: ask now
                fresh.append(i)
            else:
                proposals[i] = early.truncated(self.num_drafts(seq))
        if fresh:
            requests = [self.request(batch[i]) for i in fresh]
            answers = self.proposer.propose(requests)
            _check(requests, answers)
            for i, p in zip(fresh, answers):
                proposals[i] = p
        return proposals


def _check(requests: list[DraftRequest], proposals: list[DraftProposal]) -> None:
    assert len(proposals) == len(requests)
    for req, p in zip(requests, proposals):
        if p.token_ids.numel() > req.num_draft_tokens:
            raise RuntimeError(f"proposer returned {p.token_ids.numel()} drafts, asked for {req.num_draft_tokens}")
