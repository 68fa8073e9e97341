"""Paged KV cache bookkeeping: allocation on demand, O(1)-per-block rollback, block tables."""

from __future__ import annotations

import pytest
import torch

from specd.models.kv_cache import BlockAllocator, CacheFullError, PagedKVCache


def make_cache(num_blocks: int = 6, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_blocks=num_blocks, block_size=block_size,
                        num_kv_heads=2, head_dim=8)


def test_allocator_free_list():
    alloc = BlockAllocator(3)
    assert alloc.can_allocate(3) and not alloc.can_allocate(4)
    blocks = alloc.allocate(2)
    assert len(set(blocks)) == 2 and alloc.num_free_blocks == 1
    with pytest.raises(CacheFullError):
        alloc.allocate(2)
    alloc.free(blocks)
    assert alloc.num_free_blocks == 3
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_append_slots_crosses_block_boundaries():
    cache = make_cache()
    cache.add_sequence(7)
    slots = cache.append_slots(7, 6)  # 6 tokens -> 2 blocks
    table = cache.block_table(7)
    assert len(table) == 2 and cache.num_tokens(7) == 6
    assert slots == [table[t // 4] * 4 + t % 4 for t in range(6)]
    more = cache.append_slots(7, 3)  # tokens 6..8: fills block 1, opens block 2
    table = cache.block_table(7)
    assert len(table) == 3
    assert more == [table[1] * 4 + 2, table[1] * 4 + 3, table[2] * 4]
    assert cache.num_new_blocks(7, 3) == 0 and cache.num_new_blocks(7, 4) == 1


def test_slots_follow_the_block_table_through_appends_and_rollbacks():
    """Every slot is block_table[t // bs] * bs + t % bs, whether an append stays in one block (the
    fast path), crosses blocks, is empty, or follows a truncate."""
    import random

    rng = random.Random(0)
    cache = make_cache(num_blocks=40, block_size=4)
    cache.add_sequence(1)
    for _ in range(200):
        if rng.random() < 0.3 and cache.num_tokens(1):
            cache.truncate(1, rng.randrange(cache.num_tokens(1) + 1))
            continue
        n = rng.choice([0, 1, 3, 4, 5, 9])
        if cache.num_tokens(1) + n > 40 * 4:
            cache.truncate(1, 0)
        start = cache.num_tokens(1)
        slots = cache.append_slots(1, n)
        table = cache.block_table(1)
        assert slots == [table[t // 4] * 4 + t % 4 for t in range(start, start + n)]
        assert len(table) == -(-(start + n) // 4) and cache.num_tokens(1) == start + n


def test_truncate_frees_whole_blocks_without_copying():
    cache = make_cache()
    cache.add_sequence(0)
    cache.append_slots(0, 10)  # 3 blocks
    cache.k_caches[0].fill_(1.0)
    table = cache.block_table(0)
    cache.truncate(0, 8)  # exactly 2 blocks
    assert cache.block_table(0) == table[:2] and cache.allocator.num_free_blocks == 4
    cache.truncate(0, 5)  # still 2 blocks
    assert cache.block_table(0) == table[:2] and cache.num_tokens(0) == 5
    assert torch.all(cache.k_caches[0] == 1.0)  # data untouched
    assert cache.append_slots(0, 1) == [table[1] * 4 + 1]  # the next token reuses slot 5
    with pytest.raises(ValueError):
        cache.truncate(0, 7)
    cache.truncate(0, 0)
    assert cache.block_table(0) == [] and cache.allocator.num_free_blocks == 6


def test_capacity_free_and_block_tables():
    cache = make_cache(num_blocks=3)
    cache.add_sequence(1)
    cache.add_sequence(2)
    assert cache.can_append(1, 12) and not cache.can_append(1, 13)
    cache.append_slots(1, 5)
    cache.append_slots(2, 1)
    assert not cache.can_append(2, 5)
    with pytest.raises(CacheFullError):
        cache.append_slots(2, 5)
    tables = cache.block_tables([2, 1])
    assert tables.dtype == torch.int32 and tables.shape == (2, 2)
    assert tables[0, 0].item() == cache.block_table(2)[0] and tables[1].tolist() == cache.block_table(1)
    cache.free(1)
    assert cache.allocator.num_free_blocks == 2 and not cache.has_sequence(1)
    with pytest.raises(KeyError):
        cache.num_tokens(1)
    with pytest.raises(ValueError):
        cache.add_sequence(2)


def test_bytes_per_block():
    assert PagedKVCache.bytes_per_block(2, 4, 2, 8, torch.bfloat16) == 2 * 2 * 4 * 2 * 8 * 2
