"""Tensor parallelism for the Llama-family target over torch.distributed (Megatron layout).

Every rank of the process group holds:
- q/k/v and gate/up column-parallel: a contiguous slice of the output features, i.e. of the
  attention heads (num_heads / tp query heads and num_kv_heads / tp KV heads, so rank r's query
  heads map onto rank r's KV heads exactly as grouped-query attention pairs them unsharded) and of
  the MLP's intermediate features. The fused qkv_proj / gate_up_proj (merged_linear.py) are cut
  part by part: rank r's fused weight is [q slice r; k slice r; v slice r], the fusion of its
  unfused slices, so the per-rank forward splits it exactly as the unsharded one does;
- o and down row-parallel: the matching slice of the input features; the partial outputs are
  summed by one all_reduce per projection (llama.row_parallel), the bias added once after it;
- embeddings, norms and lm_head replicated (the logits come out whole and identical on every
  rank, so each rank can sample the same tokens without a gather);
- a KV cache of its own KV heads only (the runner sizes it with num_kv_heads / tp).

SPMD: every rank runs the same engine on the same requests; identical logits and seeds give
identical tokens, so the ranks' block tables never diverge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specd.models.merged_linear import MergedLinear


@dataclass(frozen=True)
class ParallelConfig:
    """Where this process sits in the tensor-parallel group."""

    rank: int
    world_size: int
    group: object  # a torch.distributed ProcessGroup

    @classmethod
    def from_default_group(cls, tp: int) -> "ParallelConfig":
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"tp={tp}: tensor parallelism needs torch.distributed initialised "
                               "(torchrun, or init_process_group) with one process per rank")
        if dist.get_world_size() != tp:
            raise RuntimeError(f"tp={tp}: the process group has {dist.get_world_size()} ranks")
        return cls(rank=dist.get_rank(), world_size=tp, group=dist.group.WORLD)


def check_divisible(config, tp: int) -> None:
    """Heads, KV heads and the MLP width must split evenly over the ranks."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % tp:
            raise ValueError(f"tp={tp}: {name}={value} is not divisible by tp")


def _slice_in_(linear: nn.Linear, rank: int, world: int) -> None:
    """Keep this rank's slice of the input features (weight columns); the bias stays whole."""
    n = linear.in_features // world
    cols = slice(rank * n, (rank + 1) * n)
    linear.weight = nn.Parameter(linear.weight.data[:, cols].contiguous(), requires_grad=False)
    linear.in_features = n


def shard_llama_(model, parallel: ParallelConfig) -> None:
    """Cut a loaded (full) LlamaForCausalLM down to this rank's shard, in place."""
    rank, world = parallel.rank, parallel.world_size
    check_divisible(model.config, world)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, mlp.gate_up_proj):
            assert isinstance(linear, MergedLinear), type(linear)
            linear.shard_(rank, world)
        for linear in (attn.o_proj, mlp.down_proj):
            _slice_in_(linear, rank, world)
        attn.num_heads //= world
        attn.num_kv_heads //= world
        attn.tp_group = parallel.group
        mlp.tp_group = parallel.group
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the full matrices are gone; give their memory to the KV cache
