"""Turn a batch's verify forward into padded tensors for rejection sampling.

Each request verifies its last committed token plus its k_i draft tokens (k_i may differ per
request, 0 included): k_i + 1 logits rows. Rows are padded to K + 1 = max k_i + 1 per request.
"""

from __future__ import annotations

import torch

from specd.engine.constraints import keep_grammar_rows, mask_rows
from specd.models.base import ForwardOutput
from specd.proposers.base import DraftProposal
from specd.sampling import (SamplingTensors, apply_logit_bias, apply_presence_frequency_penalties,
                            apply_repetition_penalty, processed_probs)


class BatchSamplingTensors:
    """The verify batch's sampling parameters on the device, built again only when the batch
    changes (a sequence's parameters are fixed for its life): a steady batch copies nothing."""

    def __init__(self) -> None:
        self._seq_ids: tuple[int, ...] | None = None
        self._tensors: SamplingTensors | None = None

    def get(self, batch: list, device: torch.device) -> SamplingTensors:
        """batch: the step's Sequences, in order."""
        seq_ids = tuple(s.seq_id for s in batch)
        if seq_ids != self._seq_ids:
            self._seq_ids = seq_ids
            self._tensors = SamplingTensors.from_params([s.params for s in batch], device)
        return self._tensors


def pad_drafts(proposals: list[DraftProposal], host_drafts: list[list[int]], vocab_size: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Stack per-request drafts; host_drafts[i]: proposal i's token ids as a list (the engine
    has them already: one tensor built from lists, not a slice assignment per request).

    Returns draft_token_ids [B, K] (0-padded), draft_probs [B, K, V] or None when every draft is
    one-hot, num_draft_tokens [B]. Ids and counts are assembled on the host and copied once
    (not one small copy per request).
    """
    num_drafts = [len(d) for d in host_drafts]
    batch, max_k = len(proposals), max(num_drafts, default=0)
    host_ids = torch.tensor([d + [0] * (max_k - len(d)) for d in host_drafts], dtype=torch.long
                            ).reshape(batch, max_k)
    token_ids = host_ids.to(device, non_blocking=True)
    any_probs = any(p.probs is not None and k for p, k in zip(proposals, num_drafts))
    probs = torch.zeros(batch, max_k, vocab_size, device=device) if any_probs else None
    if probs is not None:
        for i, (p, k) in enumerate(zip(proposals, num_drafts)):
            if k == 0:
                continue
            if p.probs is None:  # one-hot draft next to sampled drafts of other requests
                probs[i, torch.arange(k, device=device), token_ids[i, :k]] = 1.0
            else:
                assert p.probs.shape == (k, vocab_size), f"draft probs {tuple(p.probs.shape)} != {(k, vocab_size)}"
                probs[i, :k] = p.probs.to(device=device, dtype=torch.float32)
    return token_ids, probs, torch.tensor(num_drafts, dtype=torch.long).to(device, non_blocking=True)


def greedy_probs(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> one-hot at argmax, [N, V] float32: processed_probs' greedy rows, without its sort."""
    return torch.zeros(logits.shape, device=logits.device).scatter_(
        1, logits.float().argmax(dim=-1, keepdim=True), 1.0)


def penalized_logits(logits: torch.Tensor, num_drafts: list[int], st: SamplingTensors,
                     histories: list[tuple[list[int], list[int]]] | None, draft_token_ids: list[list[int]],
                     logit_biases: list[dict[int, float]] | None) -> torch.Tensor:
    """logits [sum(k_i + 1), V], request i's k_i + 1 verified rows in turn: its logit_bias added,
    then the penalties over what precedes each row (vLLM's order): the repetition penalty over
    prompt + output + the drafts before the row, presence and frequency over output + those drafts.
    histories[i] = (prompt, output) of request i; None where no request has a penalty.
    logit_biases: one dict per request, None where none has a bias."""
    if logit_biases is not None:
        logits = apply_logit_bias(logits, [b for b, k in zip(logit_biases, num_drafts) for _ in range(k + 1)])
    if histories is None:
        return logits
    row_st = st.repeat_interleave(torch.tensor([k + 1 for k in num_drafts]), output_size=logits.shape[0])
    contexts, outputs = [], []
    for (prompt, output), drafts, k in zip(histories, draft_token_ids, num_drafts):
        for j in range(k + 1):
            outputs.append(torch.tensor(output + list(drafts[:j]), dtype=torch.long))
            contexts.append(torch.cat([torch.tensor(prompt, dtype=torch.long), outputs[-1]]))
    logits = apply_repetition_penalty(logits, contexts, row_st.repetition_penalty)
    return apply_presence_frequency_penalties(logits, outputs, row_st.presence_penalty, row_st.frequency_penalty)


def verify_logits(out: ForwardOutput, num_drafts: list[int], st: SamplingTensors,
                  histories: list[tuple[list[int], list[int]]] | None, draft_token_ids: list[list[int]],
                  suppress: list[tuple[int, list[int]]] | None = None, masks: list | None = None,
                  logit_biases: list[dict[int, float]] | None = None) -> torch.Tensor:
    """The verified rows' logits with the request's processors applied, [sum(k_i + 1), V].

    Row j of request i is the one after its committed tokens and drafts 0..j-1.
    draft_token_ids: the drafts per request on the host (for the penalties' histories).
    histories[i] = (prompt, output) of request i, for the penalties (penalized_logits), None
    where no request has one; logit_biases likewise. suppress[i] =
    (num_rows, token_ids): those ids are masked out of request i's first num_rows rows, which is
    how min_new_tokens keeps EOS and stop tokens from ending a sequence too early. masks[i] (a
    grammar MaskResult or None) restricts request i's rows serially along its drafts.

    Index tensors are built on the host and copied without a sync; nothing here reads the device.
    """
    batch = len(num_drafts)
    device = out.logits.device
    num_rows = sum(num_drafts) + batch
    if out.offsets[-1] == num_rows:  # each chunk is just its k_i + 1 rows (the engine's verify batch)
        logits = out.logits  # no gather: a [T, V] device copy saved (131 MB at batch 64 and 8B)
    else:
        rows = torch.tensor([r for i, k in enumerate(num_drafts)
                             for r in range(out.offsets[i], out.offsets[i] + k + 1)], dtype=torch.long)
        logits = out.logits[rows.to(device, non_blocking=True)]  # [sum(k_i + 1), V]
    logits = penalized_logits(logits, num_drafts, st, histories, draft_token_ids, logit_biases)
    if masks is not None:
        starts = [0]
        for k in num_drafts[:-1]:
            starts.append(starts[-1] + k + 1)
        logits = mask_rows(logits, starts, masks)
    if suppress is not None:
        grammar_logits = logits
        logits = logits.clone()
        r = 0
        for i, k in enumerate(num_drafts):
            n_rows, token_ids = suppress[i]
            if n_rows > 0 and token_ids:
                logits[r:r + min(n_rows, k + 1), token_ids] = float("-inf")
            r += k + 1
        if masks is not None and any(m is not None for m in masks):
            logits = keep_grammar_rows(grammar_logits, logits)
    return logits


def target_probs_of(logits: torch.Tensor, num_drafts: list[int], st: SamplingTensors,
                    all_greedy: bool = False) -> torch.Tensor:
    """verify_logits's rows [sum(k_i + 1), V] as processed distributions [B, K + 1, V] (padding
    rows repeat a request's last, never read). all_greedy: every request is greedy (known on the
    host), so the filters' vocabulary sort is skipped: the same one-hot rows processed_probs gives."""
    batch, max_k = len(num_drafts), max(num_drafts, default=0)
    device = logits.device
    num_rows = sum(num_drafts) + batch
    counts = torch.tensor([k + 1 for k in num_drafts])
    if all_greedy:
        probs = greedy_probs(logits)  # [sum(k_i + 1), V]
    else:
        probs = processed_probs(logits, st.repeat_interleave(counts, output_size=num_rows))
    if all(k == max_k for k in num_drafts):  # nothing to pad: the rows are [B, K + 1] already
        return probs.reshape(batch, max_k + 1, -1)
    # Pad to [B, K + 1] with one gather: padding rows repeat the request's last row (never read,
    # kept valid).
    starts = torch.cumsum(counts, 0) - counts  # [B]
    j = torch.arange(max_k + 1)[None, :]  # [1, K + 1]
    index = starts[:, None] + torch.minimum(j, counts[:, None] - 1)  # [B, K + 1]
    return probs[index.view(-1).to(device, non_blocking=True)].view(batch, max_k + 1, -1)
