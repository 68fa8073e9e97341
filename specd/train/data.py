"""Batches for the drafters: corpus windows mixed with the target's own greedy continuations."""

from __future__ import annotations

import torch

from specd.train.corpus import WindowSampler
from specd.train.features import greedy_continuations


def self_distillation_pool(target, sampler: WindowSampler, num_batches: int, device: torch.device,
                           prompt_len: int = 32) -> torch.Tensor:
    """[num_batches * B, seq_len] rows: corpus prompts continued by the target's greedy decoding."""
    rows = []
    for _ in range(num_batches):
        prompts = sampler.next(device)[:, :prompt_len]
        rows.append(greedy_continuations(target, prompts, sampler.seq_len - prompt_len).cpu())
    return torch.cat(rows)


class DrafterBatches:
    """Each batch is a corpus window batch or, with probability `self_fraction`, rows drawn from
    the self-distillation pool (made once, up front)."""

    def __init__(self, sampler: WindowSampler, pool: torch.Tensor | None, device: torch.device,
                 self_fraction: float, seed: int) -> None:
        if not 0.0 <= self_fraction <= 1.0:
            raise ValueError(f"self_fraction: must be in [0, 1], got {self_fraction}")
        if pool is not None and pool.shape[1] != sampler.seq_len:
            raise ValueError(f"pool rows of {pool.shape[1]} tokens != seq_len {sampler.seq_len}")
        self.sampler, self.pool, self.device = sampler, pool, device
        self.self_fraction = self_fraction if pool is not None else 0.0
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        if float(torch.rand((), generator=self.gen)) >= self.self_fraction:
            return self.sampler.next(self.device)
        idx = torch.randint(0, self.pool.shape[0], (self.sampler.batch_size,), generator=self.gen)
        return self.pool[idx].to(self.device)
