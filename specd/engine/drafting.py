"""The draft verb of an engine step, and drafting ahead.

Each step asks the proposer for k_i drafts per sequence in one batched call, handing it the tokens
(and hidden rows) committed since its last call. With a proposer that answers asynchronously
(RemoteProposer.propose_async), the next step's requests leave right after each commit
(`send_ahead`) and the step collects them first thing (`collect`): the drafters draft while the
verifier writes results and admits, and the round trip leaves the critical path. What changed in
between is settled in `draft`: a sequence that left the batch drops its drafts, one given tokens
anew (an admission, a resync) is asked in the step itself, and drafts are cut to the k that fits.

Carried drafts (`carry` > 0): each request asks for `carry` drafts past k, a guess at the step's
bonus token and what follows. When a step accepts all k drafts and its bonus token is that guess,
the rest continue the context the next step verifies, which takes them without asking the drafter
(CARRY_STEPS steps' worth by default): worth it where extra drafts cost the drafter nothing
(n-gram, replay) and a round trip is a network's.

All of it stays lossless, sampled requests included: rejection sampling is exact for any proposal
drawn from the distribution it is given, whatever its timing or conditioning; the guess check only
keeps drafts conditioned on a wrong token from being verified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specd import settings
from specd.engine.sequence import Sequence
from specd.models.append_plan import AppendPlan
from specd.proposers.base import DraftProposal, DraftRequest, Proposer

FREE_DRAFT_METHODS = ("ngram", "replay")  # lookups: drafts past k cost the drafter nothing


CARRY_STEPS = 2  # steps' worth of drafts carried past k by default: a carried step that keeps
#                 all and guesses right carries the rest on (at rate r, a step is carried with
#                 probability ~(1 - r)^(k+1) as against ~half that when only one step's worth is)


def default_carry(proposer: Proposer | None, num_speculative_tokens: int) -> int:
    """SPECD_DRAFT_CARRY when set; else CARRY_STEPS * (k + 1) (per step: a guess at the bonus token and
    that step's k drafts) where the proposer answers asynchronously (over the network) and its
    extra drafts are free, 0 elsewhere (a model drafter would pay a forward per extra draft)."""
    value = settings.DRAFT_CARRY.get()
    if value is not None:
        return value
    remote = proposer is not None and hasattr(proposer, "propose_async")
    free = remote and getattr(proposer, "method", "") in FREE_DRAFT_METHODS
    return CARRY_STEPS * (num_speculative_tokens + 1) if free else 0


@dataclass(frozen=True)
class _Surplus:
    """A step's drafts past its k: `guess` at the step's bonus token, then `rest` (drafts after it)."""

    guess: int
    rest: DraftProposal


NO_DRAFTS = DraftProposal(torch.empty(0, dtype=torch.long))  # a step without drafts (read-only)


class Drafting:
    """Draft requests of one engine: asked in the step, or sent ahead; drafts carried over from
    one step to the next (see the module doc)."""

    def __init__(self, proposer: Proposer | None, num_drafts: Callable[[Sequence], int], ahead: bool,
                 carry: int = 0) -> None:
        if carry < 0:
            raise ValueError(f"carry: must be >= 0, got {carry}")
        self.proposer = proposer
        self.num_drafts = num_drafts  # k for a sequence now (the engine's budget and cache room)
        self.ahead = ahead
        self.carry = carry  # drafts asked past k per request (0: none carried)
        self._sent: tuple[list[DraftRequest], object] | None = None  # requests, their pending answer
        self._surplus: dict[int, _Surplus] = {}  # seq id -> this step's drafts past its k
        self._carried: dict[int, DraftProposal] = {}  # seq id -> the next step's drafts, checked
        self.num_carried = 0  # sequence-steps drafted from carried drafts (tests, logs)

    @property
    def in_flight(self) -> bool:
        """Whether requests sent ahead wait to be collected."""
        return self._sent is not None

    def request(self, seq: Sequence) -> DraftRequest:
        """What the drafter has not seen of seq (taken from it), and the k it may draft (plus
        `carry` past it, within what the proposer serves)."""
        tokens, hidden = seq.take_undrafted()
        k = self.num_drafts(seq)
        if k > 0 and self.carry:
            k = min(k + self.carry, getattr(self.proposer, "max_num_draft_tokens", None) or k + self.carry)
        return DraftRequest(seq.seq_id, tokens, hidden, k, num_output_tokens=seq.num_output_tokens)

    def send_ahead(self, batch: list[Sequence]) -> None:
        """Right after a commit: the next step's requests of `batch` go out now, where the
        proposer answers asynchronously and drafting ahead is on (not for sequences that carry
        their next drafts over)."""
        submit = getattr(self.proposer, "propose_async", None) if self.ahead else None
        batch = [seq for seq in batch if seq.seq_id not in self._carried]
        if submit is not None and not any(self.num_drafts(seq) for seq in batch):
            return  # a step where nobody drafts asks the drafter nothing (its tokens wait: request)
        if submit is None or not batch:
            return
        requests = [self.request(seq) for seq in batch]
        self._sent = (requests, submit(requests))

    def settle(self, seq: Sequence, num_drafts: int, num_accepted: int, emitted: list[int]) -> None:
        """After seq's verify step (num_drafts verified, num_accepted of them kept, `emitted`
        the tokens appended: the kept drafts and the bonus, fewer where the sequence stopped):
        its drafts past k carry over when every draft was kept and the bonus is their guess."""
        surplus = self._surplus.pop(seq.seq_id, None)
        if (surplus is not None and not seq.is_finished and num_accepted == num_drafts
                and len(emitted) == num_drafts + 1 and emitted[-1] == surplus.guess):
            self._carried[seq.seq_id] = surplus.rest

    def _split(self, seq: Sequence, proposal: DraftProposal) -> DraftProposal:
        """The step's k drafts of a proposal; its drafts past them wait for the verdict (settle)."""
        k = self.num_drafts(seq)
        if proposal.token_ids.numel() > k + 1:
            probs = proposal.probs
            self._surplus[seq.seq_id] = _Surplus(
                int(proposal.token_ids[k]),
                DraftProposal(proposal.token_ids[k + 1:], None if probs is None else probs[k + 1:]))
        return proposal.truncated(k)

    def collect(self) -> dict[int, DraftProposal]:
        """The drafts sent ahead by the last step, by sequence id (empty when none were)."""
        if self._sent is None:
            return {}
        (requests, pending), self._sent = self._sent, None
        proposals = pending.result()
        _check(requests, proposals)
        return {req.seq_id: p for req, p in zip(requests, proposals)}

    def draft(self, batch: list[Sequence], sent_ahead: dict[int, DraftProposal], ask: bool = True
              ) -> list[DraftProposal]:
        """k_i drafts per sequence of batch: the ones sent ahead where they still apply, the rest
        from one batched proposer call. ask=False (every k_i is 0): none, and the drafter is not
        called; the tokens it has not seen wait in each sequence for its next request."""
        carried, self._carried, self._surplus = self._carried, {}, {}
        if self.proposer is None or not batch or not ask:
            return [NO_DRAFTS] * len(batch)
        proposals: list[DraftProposal | None] = [None] * len(batch)
        fresh: list[int] = []
        for i, seq in enumerate(batch):
            early = sent_ahead.get(seq.seq_id)
            if seq.seq_id in carried:  # checked by settle: they continue the context verified now
                proposals[i] = self._split(seq, carried[seq.seq_id])
                self.num_carried += proposals[i].token_ids.numel() > 0
            elif early is None or seq.undrafted_token_ids:  # tokens the drafter has not seen: ask now
                fresh.append(i)
            else:
                proposals[i] = self._split(seq, early)
        if fresh:
            requests = [self.request(batch[i]) for i in fresh]
            answers = self.proposer.propose(requests)
            _check(requests, answers)
            for i, p in zip(fresh, answers):
                proposals[i] = self._split(batch[i], p)
        return proposals


def _check(requests: list[DraftRequest], proposals: list[DraftProposal]) -> None:
    assert len(proposals) == len(requests)
    for req, p in zip(requests, proposals):
        if p.token_ids.numel() > req.num_draft_tokens:
            raise RuntimeError(f"proposer returned {p.token_ids.numel()} drafts, asked for {req.num_draft_tokens}")


def plan_draft_lengths(batch: list[Sequence], plan: AppendPlan, num_speculative_tokens: int,
                       max_model_len: int) -> dict[int, int]:
    """k per sequence of the batch: never past max_new_tokens or the context (the bonus token
    counts), and the batch's k + 1 tokens each within the cache's free blocks together (plan: the
    runner's fresh AppendPlan; each sequence's next token first, then drafts in batch order)."""
    def cap(seq: Sequence) -> int:  # k before the cache has its say
        room = min(seq.params.max_new_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
        return max(0, min(num_speculative_tokens, room - 1))

    if plan.fits_everyone(len(batch), num_speculative_tokens + 1) and (
            plan.session_len is None or plan.session_len >= max_model_len):
        # Every claim below would succeed (a sequence holds at most its tokens, so k + 1 <= room
        # keeps it within max_model_len, hence the session): the same ks, without the claims.
        return {seq.seq_id: cap(seq) for seq in batch}
    for s in batch:
        plan.take(s.seq_id, 1)
    ks = {}
    for seq in batch:
        k = cap(seq)
        while k > 0 and not plan.take(seq.seq_id, k + 1):
            k -= 1
        ks[seq.seq_id] = k
    return ks
