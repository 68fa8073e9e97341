"""Draft-model proposer: a small causal LM sharing the target's tokenizer drafts autoregressively.

The draft model runs on the same runner code as the target (paged KV cache, batched varlen
forward). Its cache holds the committed tokens plus the drafts of the last step; the drafts are
rolled back when the next committed tokens arrive.
"""

from __future__ import annotations

import logging

import torch

from specd.models.base import SequenceChunk, TargetRunner
from specd.models.kv_cache import CacheFullError
from specd.proposers.base import DraftProposal, DraftRequest
from specd.proposers.draft_constraints import mask_logits
from specd.random import SALT_DRAFT
from specd.sampling import SamplingTensors, processed_probs, sample_from_probs
from specd.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class DraftModelProposer:
    """Autoregressive drafting with an independent small model."""

    method = "draft_model"
    hidden_kind = "none"

    def __init__(self, runner: TargetRunner, target_vocab_size: int) -> None:
        self.runner = runner
        self.target_vocab_size = target_vocab_size
        self._history: dict[int, list[int]] = {}
        self._cached: dict[int, int] = {}  # committed tokens validly in the draft cache
        self._params: dict[int, SamplingParams] = {}
        self.draft_constraints = None  # DraftConstraints when structured output is enabled
        self.num_cache_full_steps = 0  # steps cut short because the draft KV cache was full

    def open(self, seq_id: int, params: SamplingParams, grammar=None) -> None:
        self.runner.add_sequence(seq_id)
        self._history[seq_id] = []
        self._cached[seq_id] = 0
        self._params[seq_id] = params
        if self.draft_constraints is not None:
            self.draft_constraints.open(seq_id, grammar)

    def close(self, seq_id: int) -> None:
        if seq_id in self._history:
            self.runner.free(seq_id)
            del self._history[seq_id], self._cached[seq_id], self._params[seq_id]
        if self.draft_constraints is not None:
            self.draft_constraints.close(seq_id)

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        drafts: dict[int, list[int]] = {r.seq_id: [] for r in requests}
        probs: dict[int, list[torch.Tensor]] = {r.seq_id: [] for r in requests}
        dc = self.draft_constraints
        for r in requests:
            history = self._history[r.seq_id]
            history.extend(r.new_token_ids)
            if dc is not None:
                dc.begin(r.seq_id, history[len(history) - r.num_output_tokens:])
        active = [r for r in requests if r.num_draft_tokens > 0]
        if not active:
            return [DraftProposal(torch.empty(0, dtype=torch.long)) for _ in requests]
        # Step 1 catches each cache up with its committed tokens; later steps feed one draft each.
        chunks = []
        for r in active:
            self.runner.truncate(r.seq_id, self._cached[r.seq_id])
            chunks.append(SequenceChunk(r.seq_id, self._history[r.seq_id][self._cached[r.seq_id]:]))
        for step in range(max(r.num_draft_tokens for r in active)):
            try:  # each chunk's last token only: step 1 catches up whole histories (a new prompt)
                logits = self.runner.forward(chunks, last_logits_only=True).last_logits()  # [B, draft_vocab]
            except CacheFullError:
                # The draft cache is sized apart from the verifier's (on a shared GPU, from what the
                # drafter found free): when it cannot take the step, the drafts so far go out and the
                # caches stay as they were (a later step catches up once finished sequences free
                # blocks). Fewer drafts cost speed, never output; failing the step would fail the
                # verifier's requests.
                self.num_cache_full_steps += 1
                if self.num_cache_full_steps == 1:
                    log.warning("draft model: KV cache full at %d sequences; drafting less until it frees up "
                                "(a larger --cache-max-entry-count gives it more)", len(self._history))
                break
            if step == 0:
                for r in active:
                    self._cached[r.seq_id] = len(self._history[r.seq_id])
            bitmask = None if dc is None else dc.masks([r.seq_id for r in active])
            chosen, q = self._choose(logits, active, step, bitmask)
            next_active, chunks = [], []
            for i, r in enumerate(active):
                if dc is not None and not dc.advance(r.seq_id, chosen[i]):
                    continue  # the grammar allows nothing more: this sequence's drafts end here
                drafts[r.seq_id].append(chosen[i])
                if q is not None:
                    probs[r.seq_id].append(q[i])
                if len(drafts[r.seq_id]) < r.num_draft_tokens and self.runner.can_append(r.seq_id, 1):
                    next_active.append(r)
                    chunks.append(SequenceChunk(r.seq_id, [chosen[i]]))
            active = next_active
            if not active:
                break
        return [self._proposal(drafts[r.seq_id], probs[r.seq_id], r.seq_id) for r in requests]

    def _choose(self, logits: torch.Tensor, reqs: list[DraftRequest], step: int, bitmask=None):
        """Greedy or sampled draft token per row; q in the target vocabulary for sampled rows."""
        params = [self._params[r.seq_id] for r in reqs]
        logits = mask_logits(self._to_target_vocab(logits.float()), bitmask)
        if all(p.is_greedy for p in params):
            return logits.argmax(dim=-1).tolist(), None
        st = SamplingTensors.from_params(params, logits.device)
        q = processed_probs(logits, st)  # [B, V]; greedy rows are one-hot
        positions = torch.tensor([len(self._history[r.seq_id]) + step for r in reqs], device=logits.device)
        return sample_from_probs(q, st.seeds, positions, SALT_DRAFT).tolist(), q

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft and target may pad their vocabularies differently; ids beyond either are masked."""
        v = self.target_vocab_size
        if logits.shape[-1] >= v:
            return logits[:, :v]
        pad = torch.full((logits.shape[0], v - logits.shape[-1]), float("-inf"), device=logits.device)
        return torch.cat([logits, pad], dim=-1)

    def _proposal(self, tokens: list[int], probs: list[torch.Tensor], seq_id: int) -> DraftProposal:
        token_ids = torch.tensor(tokens, dtype=torch.long)
        if not probs or self._params[seq_id].is_greedy:
            return DraftProposal(token_ids)
        return DraftProposal(token_ids, torch.stack(probs).cpu())
