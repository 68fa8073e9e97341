"""The draft heads' KV cache (EAGLE-3, MTP): paged buffers, one per cached tensor.

A head has one attention layer; what it caches per position is a few tensors (k and v, or MLA's
two latents), each [heads, dim] per position. `HeadKVCache` keeps each as a pool of blocks
[num_blocks, block_size, heads, dim] and every open sequence a list of blocks, as the target's paged
cache does: a sequence holds the blocks its positions need, so memory follows the tokens held
(a slot per sequence sized for the longest would hold 128 x 32k positions for one long prompt).
The sequence keeps its own length, so dropping last step's speculative entries is a number, not a
copy. `BatchKV` is one forward's view of a batch: every sequence's past gathered through the
block tables in one index_select per tensor, padded to the longest, the new entries copied in
with one index_copy_ per tensor, and the mask that keeps sequences apart.

Why not a tensor per sequence: the batch would be copied together one sequence at a time and
each cache grown by a concatenation, every draft step: ~1,200 small copies a propose at batch 64
(bench/drafter_head.py's profile), most of an 8B EAGLE-3 drafter's host time.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from specd.models.kernels import paged_decode_attention
from specd.models.static_attention import StaticAttentionMetadata, static_paged_attention

BLOCK = 64  # positions a block, by default: the verifier's; its paged kernel reads 64-key tiles (within 4% of 16)
SCRATCH_BLOCK = 0  # no sequence's: padding rows of a fixed-shape batch write here (StaticBatchKV)


def _grown(table: np.ndarray, rows: int = 0, cols: int = 0) -> np.ndarray:
    """table enlarged to at least rows x cols, its entries kept, the new ones SCRATCH_BLOCK."""
    bigger = np.full((max(rows, table.shape[0]), max(cols, table.shape[1])), SCRATCH_BLOCK, dtype=table.dtype)
    bigger[:table.shape[0], :table.shape[1]] = table
    return bigger


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Grouped-query attention of q [B, Hq, S, D] over gathered keys, values [B, Hkv, L, D] under a
    bool mask [B, 1, S, L] (True = attend) -> [B, S, Hq, D]. What BatchKV and the training's
    views (specd/train/ttt.py) run; with a mask SDPA takes no enable_gqa on a fused kernel, so the
    keys are repeated per query head."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale).transpose(1, 2)


class HeadKVCache:
    """Block pools [num_blocks, block_size, heads_t, dim_t], one per cached tensor t, on `device`.

    The pools are allocated at the first `materialize` (their shapes and dtype come from the
    head's tensors); the block count doubles when the free blocks run out, keeping what they hold.
    `generation` counts the allocations: a CUDA graph holds the pools it was captured with.
    Handles (acquire / release) name the sequences; `reserve` gives a handle blocks for a length.
    """

    def __init__(self, device: torch.device | str, initial_blocks: int = 64, block_size: int = BLOCK) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {block_size}")
        self.device = torch.device(device)
        self.block_size = block_size
        self.pools: list[torch.Tensor] | None = None
        self.generation = 0
        self.num_blocks = max(2, initial_blocks)
        # pop() gives the lowest first; SCRATCH_BLOCK is never handed out
        self._free_blocks = [b for b in range(self.num_blocks - 1, -1, -1) if b != SCRATCH_BLOCK]
        self._tables: dict[int, list[int]] = {}  # handle -> its blocks, in position order
        # The same tables as one host array, row = handle, SCRATCH_BLOCK past a handle's blocks:
        # a batch's padded tables are then one gather (block_tables), not a list per sequence
        # (~1.6 ms a forward at batch 128 and 1,024 positions on the CI machine, three a propose).
        self._table_rows = np.full((16, 16), SCRATCH_BLOCK, dtype=np.int64)
        self._free_handles: list[int] = []  # released handles, reused (their rows stay small)
        self._next_handle = 0

    def acquire(self) -> int:
        if self._free_handles:
            handle = self._free_handles.pop()
        else:
            handle, self._next_handle = self._next_handle, self._next_handle + 1
            if handle >= self._table_rows.shape[0]:
                self._table_rows = _grown(self._table_rows, rows=2 * handle)
        self._tables[handle] = []
        return handle

    def release(self, handle: int) -> None:
        blocks = self._tables.pop(handle)
        self._table_rows[handle, :len(blocks)] = SCRATCH_BLOCK
        self._free_blocks.extend(reversed(blocks))
        self._free_handles.append(handle)

    def reserve(self, handle: int, length: int) -> list[int]:
        """The handle's blocks, enough for `length` positions (more are taken as needed)."""
        table = self._tables[handle]
        while len(table) * self.block_size < length:
            if not self._free_blocks:
                self._free_blocks = list(range(2 * self.num_blocks - 1, self.num_blocks - 1, -1))
                self.num_blocks *= 2
            if len(table) >= self._table_rows.shape[1]:
                self._table_rows = _grown(self._table_rows, cols=2 * len(table))
            self._table_rows[handle, len(table)] = block = self._free_blocks.pop()
            table.append(block)
        return table

    def block_tables(self, handles: list[int], width: int) -> torch.Tensor:
        """[len(handles), width] int64 (host): each handle's first `width` blocks, SCRATCH_BLOCK past
        its own."""
        if width > self._table_rows.shape[1]:
            self._table_rows = _grown(self._table_rows, cols=width)
        return torch.from_numpy(self._table_rows[handles, :width])

    def materialize(self, new: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The pools, allocated after `new` ([B, heads, S, dim] each) or grown to num_blocks."""
        if self.pools is None:
            self.pools = [t.new_zeros(self.num_blocks, self.block_size, t.shape[1], t.shape[3]) for t in new]
            self.generation += 1
        else:
            self.grow()
        return self.pools

    def grow(self) -> None:
        """Reallocate the pools (keeping their contents) if reserve took them past their size."""
        if self.pools is None or self.pools[0].shape[0] >= self.num_blocks:
            return
        grown = []
        for pool in self.pools:
            bigger = pool.new_zeros(self.num_blocks, *pool.shape[1:])
            bigger[:pool.shape[0]] = pool
            grown.append(bigger)
        self.pools = grown
        self.generation += 1


class BatchKV:
    """One forward's keys over a batch of sequences in a HeadKVCache.

    handles[i], past_lens[i]: sequence i's handle and cached positions; query_lens[i]: its new
    ones. Keys of the batch are [past padded to max_past | new], so query j of sequence i sees its
    own past (slots < past_lens[i]) and new slots max_past .. max_past + j. `update` stores the
    valid new entries at positions past_lens[i] .. past_lens[i] + query_lens[i] - 1 of sequence i;
    the caller then adds query_lens[i] to the sequence's length.
    """

    def __init__(self, cache: HeadKVCache, handles: list[int], past_lens: list[int],
                 query_lens: list[int]) -> None:
        self.cache = cache
        self.max_past = max(past_lens)
        device = cache.device
        batch, num_q = len(handles), max(query_lens)
        tables = [cache.reserve(h, p + q) for h, p, q in zip(handles, past_lens, query_lens)]
        size = cache.block_size
        self._past_blocks = -(-self.max_past // size)
        # Every sequence's first past_blocks blocks (padded with block 0, masked out); the pool row
        # of each valid new entry (b, j): its position past_lens[b] + j through b's table; and, when
        # some sequence brings several positions, each entry's (b, j). All the host's integers go
        # over in one copy (each is a wait on the device otherwise).
        rows = [(b, j) for b, q in enumerate(query_lens) for j in range(q)]
        one_each = num_q == 1  # a draft step: entry b is new[b, :, 0]
        ints = torch.tensor([
            *past_lens, *query_lens,
            *(t[i] if i < len(t) else 0 for t in tables for i in range(self._past_blocks)),
            *(tables[b][(past_lens[b] + j) // size] * size + (past_lens[b] + j) % size for b, j in rows),
            *(() if one_each else (b for b, _ in rows)), *(() if one_each else (j for _, j in rows)),
        ], dtype=torch.long).to(device)
        sizes = [batch, batch, batch * self._past_blocks, len(rows)] + ([] if one_each else [len(rows)] * 2)
        past_t, query_t, self._table, self._dest, *pairs = ints.split(sizes)
        self._row_b, self._row_j = pairs if pairs else (None, None)
        past_ok = torch.arange(self.max_past, device=device)[None, :] < past_t[:, None]  # [B, max_past]
        # Every query sees at least its own slot, so no row is fully masked and padded rows stay
        # finite; valid queries never see padded keys, which all come after them.
        causal = torch.ones(num_q, num_q, dtype=torch.bool, device=device).tril()  # [S, S]
        mask = torch.cat([past_ok[:, None, :].expand(-1, num_q, -1),
                          causal[None].expand(batch, -1, -1)], dim=-1)  # [B, S, past + S]
        valid_q = torch.arange(num_q, device=device)[None, :] < query_t[:, None]  # [B, S]
        mask[:, :, :self.max_past] &= valid_q[:, :, None]
        self.mask = mask[:, None]  # [B, 1, S, max_past + S] bool, True = attend

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """New entries [B, heads, S, dim] each -> the batch's keys [B, heads, max_past + S, dim];
        the valid ones are stored in the cache."""
        out = []
        batch = new[0].shape[0]
        for pool, fresh in zip(self.cache.materialize(new), new):
            fresh = fresh.to(pool.dtype)
            heads, dim = pool.shape[2], pool.shape[3]
            past = pool.index_select(0, self._table).view(batch, self._past_blocks * self.cache.block_size, heads, dim)
            out.append(torch.cat([past[:, :self.max_past].transpose(1, 2), fresh], dim=2))
            valid = fresh[:, :, 0] if self._row_b is None else fresh[self._row_b, :, self._row_j]  # [N, heads, dim]
            pool.view(-1, heads, dim).index_copy_(0, self._dest, valid)
        return tuple(out)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, S, D], new k, v [B, Hkv, S, D] -> attention [B, S, Hq, D]; the new entries stored."""
        return masked_attention(q, *self.update(k, v), self.mask, scale)


class StaticBatchKV:
    """BatchKV over fixed shapes, every index computed on the device: what a CUDA graph replays.

    table [B, NB] int64: each sequence's blocks (padding: SCRATCH_BLOCK); past_lens, query_lens
    [B] int64 (a padding row: 0 and 0); Q new positions a row. `update`: keys are [NB * block_size
    past slots | Q new], the mask as BatchKV's (max_past = NB * block_size). `attend`: the new entries are
    stored first and each row reads its keys straight from the pools, the verifier's static layout
    (specd/models/static_attention.py). New entries past a row's query_len (and all of a padding
    row's) are written to the scratch block, not to the sequence's.
    """

    def __init__(self, cache: HeadKVCache, table: torch.Tensor, past_lens: torch.Tensor,
                 query_lens: torch.Tensor, num_q: int) -> None:
        self.cache = cache
        batch, width = table.shape
        size = cache.block_size
        self.max_past = width * size
        self._table = table.reshape(-1)
        new = torch.arange(num_q, device=table.device)  # [Q]
        pos = past_lens[:, None] + new  # [B, Q]
        valid_q = new[None, :] < query_lens[:, None]  # [B, Q]
        block = table.gather(1, (pos // size).clamp(max=width - 1))
        dest = torch.where(valid_q, block * size + pos % size, SCRATCH_BLOCK * size + new)
        self._dest = dest.reshape(-1)  # [B * Q]
        self._meta = StaticAttentionMetadata(ctx_lens=past_lens, block_tables=table, slot_mapping=self._dest,
                                             query_len=num_q, block_size=size)
        self._valid_q = valid_q

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, Q, max_past + Q] bool, True = attend: `update`'s keys' mask, built only where a
        head attends through `update` (MTP); `attend` needs none (its graphs hold no mask kernels)."""
        past_lens, valid_q = self._meta.ctx_lens, self._valid_q
        batch, num_q = valid_q.shape
        past_ok = torch.arange(self.max_past, device=past_lens.device)[None, :] < past_lens[:, None]
        causal = torch.ones(num_q, num_q, dtype=torch.bool, device=past_lens.device).tril()
        mask = torch.cat([past_ok[:, None, :] & valid_q[:, :, None],
                          causal[None].expand(batch, -1, -1)], dim=-1)  # [B, Q, past + Q]
        return mask[:, None]

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """New entries [B, heads, Q, dim] each -> the batch's keys [B, heads, NB * block_size + Q, dim]."""
        out = []
        batch, _, num_q, _ = new[0].shape
        for pool, fresh in zip(self.cache.materialize(new), new):
            fresh = fresh.to(pool.dtype)
            heads, dim = pool.shape[2], pool.shape[3]
            past = pool.index_select(0, self._table).view(batch, self.max_past, heads, dim)
            out.append(torch.cat([past.transpose(1, 2), fresh], dim=2))
            rows = fresh.transpose(1, 2).reshape(batch * num_q, heads, dim)
            pool.view(-1, heads, dim).index_copy_(0, self._dest, rows)
        return tuple(out)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, Q, D], new k, v [B, Hkv, Q, D] -> attention [B, Q, Hq, D]: the new entries
        stored, then row i of sequence b attends its keys 0 .. past_b + i through the block table.

        Why not `update`'s gather: it copies every sequence's keys out of the pools, then again
        into the [past | new] tensor, then once per query head (repeat_interleave) for SDPA: at
        batch 128 an 8B EAGLE-3 head's forward spent ~0.6 of its ~1.3 ms of device time on them
        and the attention, with 30-150-token contexts (H100), and they grow
        with the context. On CUDA
        in bf16 / fp16 the verifier's Triton paged kernel reads the pools in place; elsewhere its
        PyTorch twin gathers once, grouped heads folded into the rows."""
        batch, num_heads, num_q, dim = q.shape
        pool_k, pool_v = self.cache.materialize((k, v))
        for pool, fresh in ((pool_k, k), (pool_v, v)):
            rows = fresh.to(pool.dtype).transpose(1, 2).reshape(batch * num_q, *pool.shape[2:])
            pool.view(-1, *pool.shape[2:]).index_copy_(0, self._dest, rows)
        q_rows = q.transpose(1, 2).reshape(batch * num_q, num_heads, dim)  # [B * Q, Hq, D]
        if paged_decode_attention.serves_query_len(num_q) and paged_decode_attention.kernel_applies(q_rows, pool_k):
            out = paged_decode_attention.paged_decode_attention(
                q_rows, pool_k, pool_v, self._meta.ctx_lens, self._meta.block_tables, num_q, scale)
        else:
            out = static_paged_attention(q_rows.to(pool_k.dtype), pool_k, pool_v, self._meta, scale).to(q.dtype)
        return out.view(batch, num_q, num_heads, dim)
