"""Block-structured (paged) KV cache, nano-vllm style.

The K/V storage of every layer is one tensor `[num_blocks, block_size, num_kv_heads, head_dim]`.
A sequence owns a list of block ids (its block table); token t of the sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size`. Appending allocates blocks on
demand; rolling back rejected draft tokens (`truncate`) only shortens the sequence's length and
returns whole blocks past the new end to the free list: no K/V data is copied or cleared, since
slots past a sequence's length are never read and are overwritten by the next append.

Prefix caching (`prefix_caching=True`): full blocks of committed tokens are registered under a key
chained over their prefix (prefix_hash.py); a new sequence whose prompt starts with registered
blocks shares them (reference counts) and prefills only the rest. A shared block is full and
never written again: a sequence's appends and rollbacks only touch blocks past its matched
prefix. Blocks no sequence holds keep their K/V and key until the allocator needs them (least
recently freed first), so a conversation's next turn finds its history.

One extra physical block past the allocator's range, `scratch_block`, is never handed out: the
static (CUDA-graph) batch layout points its padding rows and padding batch slots there, so writes
of tokens that belong to no sequence can never land in a real sequence's cache.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from specd.models.prefix_hash import chain_block_hashes


class CacheFullError(RuntimeError):
    """Not enough free KV-cache blocks for the requested append."""


class BlockAllocator:
    """Block ids: free, held (reference counted), or cached (held by no one, K/V and key kept for a
    later prefix hit, handed out again once the free ones run out, least recently freed first)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}  # prefix key -> its block
        self._key_of: dict[int, bytes] = {}  # block -> its prefix key
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced keyed blocks, oldest first
        self.num_evictions = 0  # cached blocks handed out again (tests, metrics)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise CacheFullError(f"need {num_blocks} KV-cache blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:  # evict the least recently freed cached block
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                self.num_evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds any more is free again, or cached
        when it has a key."""
        released = []
        for block in block_ids:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None  # the most recently freed: evicted last
                else:
                    released.append(block)
        # Freed blocks go to the front: they are the most recently touched, so reusing them first
        # keeps the working set small.
        self._free.extendleft(reversed(released))

    def lookup(self, key: bytes) -> int | None:
        """The block registered under a prefix key, taking a reference to it; None if none is."""
        block = self._block_of.get(key)
        if block is not None:
            self._cached.pop(block, None)
            self._refs[block] += 1
        return block

    def has(self, key: bytes) -> bool:
        return key in self._block_of

    def register(self, block: int, key: bytes) -> None:
        """Offer a held block's K/V under its prefix key (a key already registered keeps its block)."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key


@dataclass(slots=True)
class SequenceBlocks:
    """One sequence's blocks: `block_table[i]` holds tokens `i * block_size ... (i+1) * block_size - 1`."""

    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    keys: list[bytes] = field(default_factory=list)  # prefix keys of its first blocks (prefix caching)


class PagedKVCache:
    """Per-layer paged K/V storage plus the block bookkeeping of every sequence."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", prefix_caching: bool = False) -> None:
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
        self.prefix_caching = prefix_caching
        self.num_prefix_hit_tokens = 0  # tokens new sequences found cached (metrics, tests)

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
        if length < len(seq.keys) * self.block_size:  # a registered block would be written again
            raise ValueError(f"truncate: length {length} cuts into sequence {seq_id}'s registered prefix")
        keep = self._blocks_for(length)
        self.allocator.free(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.num_tokens = length

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.allocator.free(seq.block_table)

    # prefix caching -------------------------------------------------------------------------------

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """A new (empty) sequence about to prefill token_ids takes the registered blocks its prefix
        matches; returns the tokens they hold (whole blocks, at most all tokens but the last: the
        last one's logits are what the prefill is for). 0 without prefix caching."""
        seq = self._seq(seq_id)
        if not self.prefix_caching or seq.num_tokens or len(token_ids) < 2:
            return 0
        keys = chain_block_hashes(token_ids[:len(token_ids) - 1], self.block_size, [])
        for key in keys:
            block = self.allocator.lookup(key)
            if block is None:
                break
            seq.block_table.append(block)
            seq.keys.append(key)
        seq.num_tokens = len(seq.block_table) * self.block_size
        self.num_prefix_hit_tokens += seq.num_tokens
        return seq.num_tokens

    def first_block_cached(self, token_ids: list[int]) -> bool:
        """Whether the first full block of token_ids is registered (a prompt starting so would hit)."""
        if not self.prefix_caching or len(token_ids) <= self.block_size:
            return False
        return self.allocator.has(chain_block_hashes(token_ids[:self.block_size], self.block_size, [])[0])

    def register_prefix(self, seq_id: int, token_ids: list[int]) -> None:
        """Offer the sequence's full blocks that token_ids covers, token_ids being the tokens its
        cache holds from the start, committed (their K/V computed or queued before any reader)."""
        seq = self._seq(seq_id)
        if not self.prefix_caching:
            return
        num_full = min(len(token_ids), seq.num_tokens) // self.block_size
        if num_full <= len(seq.keys):
            return
        seq.keys = chain_block_hashes(token_ids[:num_full * self.block_size], self.block_size, seq.keys)
        for block, key in zip(seq.block_table[:num_full], seq.keys):
            self.allocator.register(block, key)

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
