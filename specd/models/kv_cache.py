"""Block-structured (paged) KV cache, nano-vllm style.

The K/V storage of every layer is one tensor `[num_blocks, block_size, num_kv_heads, head_dim]`.
A sequence owns a list of block ids (its block table); token t of the sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size`. Appending allocates blocks on
demand; rolling back rejected draft tokens (`truncate`) only shortens the sequence's length and
returns whole blocks past the new end to the free list: no K/V data is copied or cleared, since
slots past a sequence's length are never read and are overwritten by the next append.

One extra physical block past the allocator's range, `scratch_block`, is never handed out: the
static (CUDA-graph) batch layout points its padding rows and padding batch slots there, so writes
of tokens that belong to no sequence can never land in a real sequence's cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


class CacheFullError(RuntimeError):
    """Not enough free KV-cache blocks for the requested append."""


class BlockAllocator:
    """Free list of block ids."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise CacheFullError(f"need {num_blocks} KV-cache blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        # Freed blocks go to the front: they are the most recently touched, so reusing them first
        # keeps the working set small.
        self._free.extendleft(reversed(block_ids))


@dataclass(slots=True)
class SequenceBlocks:
    """One sequence's blocks: `block_table[i]` holds tokens `i * block_size ... (i+1) * block_size - 1`."""

    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagedKVCache:
    """Per-layer paged K/V storage plus the block bookkeeping of every sequence."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.num_layers = num_layers
        self.block_size = block_size
        self.device = torch.device(device)
        self.allocator = BlockAllocator(num_blocks)
        self.scratch_block = num_blocks  # the extra block (see the module doc)
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._seqs: dict[int, SequenceBlocks] = {}

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Memory one block takes over all layers, K and V."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    # sequence lifecycle -------------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has a cache")
        self._seqs[seq_id] = SequenceBlocks()

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def _seq(self, seq_id: int) -> SequenceBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} has no cache (call add_sequence first)") from None

    def num_tokens(self, seq_id: int) -> int:
        return self._seq(seq_id).num_tokens

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def block_table_view(self, seq_id: int) -> list[int]:
        """The sequence's block table itself, not a copy: read it before the next append or
        truncate, never write it (the static path's fill, on every step's critical path)."""
        return self._seq(seq_id).block_table

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks an append of num_tokens would allocate."""
        seq = self._seq(seq_id)
        return max(0, self._blocks_for(seq.num_tokens + num_tokens) - len(seq.block_table))

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        # num_new_blocks inlined: asked for every sequence two or three times a step.
        seq = self._seq(seq_id)
        need = -(-(seq.num_tokens + num_tokens) // self.block_size) - len(seq.block_table)
        return self.allocator.can_allocate(need)

    def append_slots(self, seq_id: int, num_tokens: int) -> list[int]:
        """Reserve the next num_tokens positions of the sequence; return their flat slot ids."""
        seq = self._seq(seq_id)
        bs, start, table = self.block_size, seq.num_tokens, seq.block_table
        end = start + num_tokens
        need = -(-end // bs) - len(table)
        if need > 0:
            table.extend(self.allocator.allocate(need))
        first = start // bs
        if num_tokens and (end - 1) // bs == first:  # within one block: a verify step's usual case
            base = table[first] * bs + start % bs
            slots = list(range(base, base + num_tokens))
        else:
            slots = [table[t // bs] * bs + t % bs for t in range(start, end)]
        seq.num_tokens = end
        return slots

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first `length` tokens; blocks wholly past them return to the free list."""
        seq = self._seq(seq_id)
        if not 0 <= length <= seq.num_tokens:
            raise ValueError(f"truncate: length {length} outside [0, {seq.num_tokens}] for sequence {seq_id}")
        keep = self._blocks_for(length)
        self.allocator.free(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.num_tokens = length

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.allocator.free(seq.block_table)

    # batch views ----------------------------------------------------------------------------------

    def block_tables(self, seq_ids: list[int], device: str | torch.device | None = None) -> torch.Tensor:
        """[batch, max_blocks] int32, padded with block 0 (never read: lengths bound every access)."""
        tables = [self._seq(s).block_table for s in seq_ids]
        width = max(1, max((len(t) for t in tables), default=1))
        out = torch.zeros((len(tables), width), dtype=torch.int32)
        for i, t in enumerate(tables):
            if t:
                out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(device or self.device)
