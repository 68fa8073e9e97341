"""EAGLE-3's training-time test: train a pair head on its own outputs over several draft steps.

At inference a pair head (specd.proposers.pair_head) drafts d_1 from committed pairs, then feeds
its own output hidden state back: draft step j's pair at position t pairs the head's step-(j-1)
output at t-1 with token x_{t+1}. Its query attends the committed (step-0) entries at positions
<= t - j, the chain origin, and the chain's own speculative entries, one per later step: step i's
entry at position t - j + i. Training reproduces exactly that view: `TTTKV` stands in for
`BatchKV` (same `attend` interface), so the head's own inference modules are trained.

All tensors of one step are laid out by pair position t in [0, N), N = T - 1 for a window of T
tokens; a step-i entry needed at row t of step j sits at row t - (j - i) of step i, so earlier
steps' keys are shifted down by (j - i) rows and masked on the diagonal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specd.proposers.head_kv import masked_attention


def shift_rows(x: torch.Tensor, by: int, dim: int) -> torch.Tensor:
    """x shifted `by` rows toward higher indices along dim; the first `by` rows become zero."""
    if by == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, by))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - by)], dim=dim)


def ttt_mask(num_pairs: int, step: int, device: torch.device) -> torch.Tensor:
    """[1, 1, N, (step + 1) * N] bool, True = attend, for draft step `step` (0 = committed pass)."""
    rows = torch.arange(num_pairs, device=device)[:, None]  # [N, 1]
    cols = torch.arange(num_pairs, device=device)[None, :]  # [1, N]
    blocks = [cols <= rows - step]  # committed entries up to the chain's origin
    for i in range(1, step + 1):  # the chain's step-i entry, valid once it exists (t >= step - i)
        blocks.append((cols == rows) & (rows >= step - i))
    return torch.cat(blocks, dim=1)[None, None]


class TTTKV:
    """The view of draft step `step` over the K/V of steps 0..step-1 (each [B, heads, N, dim])."""

    def __init__(self, past: list[tuple[torch.Tensor, ...]], step: int, num_pairs: int,
                 device: torch.device) -> None:
        if len(past) != step:
            raise ValueError(f"step {step} needs the K/V of {step} earlier steps, got {len(past)}")
        self.past, self.step = past, step
        self.mask = ttt_mask(num_pairs, step, device)
        self.new: tuple[torch.Tensor, ...] | None = None

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """New K/V [B, heads, N, dim] each -> [B, heads, (step + 1) * N, dim] each."""
        self.new = new
        out = []
        for t, fresh in enumerate(new):
            blocks = [self.past[0][t]] if self.step else []
            blocks += [shift_rows(self.past[i][t], self.step - i, dim=2)
                       for i in range(1, self.step)]
            blocks.append(fresh)
            out.append(torch.cat(blocks, dim=2))
        return tuple(out)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, N, D], this step's k, v [B, Hkv, N, D] -> attention [B, N, Hq, D]."""
        return masked_attention(q, *self.update(k, v), self.mask, scale)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, valid: torch.Tensor
                       ) -> torch.Tensor:
    """Mean over valid rows of -sum_v p(v) log q(v); logits, target_probs [B, N, V], valid [N]."""
    logq = F.log_softmax(logits.float(), dim=-1)
    per_row = -(target_probs * logq).sum(-1)  # [B, N]
    return per_row[:, valid].mean()


def ttt_step_logits(head, logits_fn, ids: torch.Tensor, first_hidden: torch.Tensor,
                    num_steps: int) -> list[torch.Tensor]:
    """Logits [B, N, V'] of every draft step for a window: the head run as it drafts.

    ids [B, T]; first_hidden [B, T, H]: the head-space row of each committed pair (the target's
    features at position t); logits_fn: [B, N, H] -> [B, N, V']. Pair t pairs hidden row t with
    x_{t+1} and predicts x_{t+2}; at step j only rows t >= j have a chain origin (t - j >= 0).
    """
    batch, seq_len = ids.shape
    num_pairs = seq_len - 1
    tokens = ids[:, 1:]  # [B, N]: x_{t+1}
    positions = torch.arange(num_pairs, device=ids.device)[None].expand(batch, -1)
    hidden = first_hidden[:, :num_pairs]
    past: list[tuple[torch.Tensor, ...]] = []
    out_logits = []
    for step in range(num_steps):
        kv = TTTKV(past, step, num_pairs, ids.device)
        out = head(tokens, hidden, positions, kv)  # [B, N, H]
        out_logits.append(logits_fn(out))
        past.append(kv.new)
        hidden = shift_rows(out, 1, dim=1)  # step j + 1 at t reads step j's output at t - 1
    return out_logits


def ttt_losses(head, logits_fn, ids: torch.Tensor, first_hidden: torch.Tensor,
               target_probs: torch.Tensor, num_steps: int
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-step soft cross-entropy to the target and top-1 agreement with it.

    target_probs [B, T, V']: the target's next-token distribution at each position, in the
    vocabulary logits_fn scores; pair t's label is the target's distribution at position t + 1.
    """
    num_pairs = ids.shape[1] - 1
    labels = target_probs[:, 1:]  # [B, N, V']
    target_top = labels.argmax(-1)
    losses, agreement = [], []
    for step, logits in enumerate(ttt_step_logits(head, logits_fn, ids, first_hidden, num_steps)):
        valid = torch.arange(num_pairs, device=ids.device) >= step  # the chain's origin exists
        losses.append(soft_cross_entropy(logits, labels, valid))
        agreement.append((logits.argmax(-1) == target_top)[:, valid].float().mean())
    return losses, agreement
