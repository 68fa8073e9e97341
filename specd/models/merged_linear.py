"""Fused projections: one GEMM where a checkpoint stores several (vLLM's QKVParallelLinear and
MergedColumnParallelLinear, without their parallel machinery).

`MergedLinear` stacks the output rows of several checkpoint linears that read the same input
(q/k/v of attention, gate/up of the MLP) into one weight, in a fixed order, so a step launches one
matrix product instead of three (or two) and reads the input once. The checkpoint keeps its names
on disk: `checkpoint_tensors` maps every checkpoint name to its rows of the fused parameter (a
view), which is what loading copies into and what a transformers twin can share.

Tensor parallelism shards each part on its own (`shard_`): rank r keeps the r-th contiguous slice
of q's rows, of k's and of v's, concatenated in the same order, so the fused weight of a rank is
exactly the fusion of that rank's unfused slices.
"""

from __future__ import annotations

import torch
from torch import nn

from specd.models.linear import Linear


class MergedLinear(Linear):
    """Linear whose output rows are the named checkpoint projections `parts`, stacked in order."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias, dtype=dtype)
        self.parts = dict(parts)  # checkpoint module name (e.g. "q_proj") -> output rows

    @property
    def part_sizes(self) -> list[int]:
        return list(self.parts.values())

    def part_rows(self) -> dict[str, slice]:
        """Each part's rows of the fused weight."""
        rows, start = {}, 0
        for name, size in self.parts.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows

    def shard_(self, rank: int, world: int) -> None:
        """Keep rank's contiguous slice of every part (column parallelism, part by part)."""
        keep = []
        for name, rows in self.part_rows().items():
            size = self.parts[name]
            if size % world:
                raise ValueError(f"tp={world}: {name} has {size} rows, not divisible by tp")
            n = size // world
            keep.append(torch.arange(rows.start + rank * n, rows.start + (rank + 1) * n))
        index = torch.cat(keep).to(self.weight.device)
        self.weight = nn.Parameter(self.weight.data.index_select(0, index), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data.index_select(0, index), requires_grad=False)
        self.parts = {name: size // world for name, size in self.parts.items()}
        self.out_features = sum(self.parts.values())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={self.parts}"


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the tensor it loads into: the parameter itself, or for a MergedLinear
    `...self_attn.qkv_proj` the rows of `...self_attn.q_proj.weight` etc. (views sharing storage).

    Tied parameters appear under every name (remove_duplicate=False), as checkpoints may hold either.
    """
    merged = {name: m for name, m in model.named_modules() if isinstance(m, MergedLinear)}
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        module = merged.get(owner)
        if module is None:
            out[name] = param
            continue
        parent = owner.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        for part, rows in module.part_rows().items():
            out[f"{prefix}{part}.{leaf}"] = param.detach()[rows]
    return out
