"""Prefix caching in the paged KV cache (specd/models/kv_cache.py): registered full blocks are
shared by reference, survive their sequences until evicted (least recently freed first), and are
never written again; a sequence rolling back its drafts leaves a shared block alone."""

from __future__ import annotations

import pytest
import torch

from specd.models.kv_cache import PagedKVCache

BLOCK = 4


def cache(num_blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=1, head_dim=2,
                        prefix_caching=True)


def prefill(kv: PagedKVCache, seq_id: int, tokens: list[int]) -> int:
    """match, append the rest, write each slot's K as its token id, register: as the engine does."""
    kv.add_sequence(seq_id)
    hit = kv.match_prefix(seq_id, tokens)
    slots = kv.append_slots(seq_id, len(tokens) - hit)
    for slot, token in zip(slots, tokens[hit:]):
        kv.k_caches[0].view(-1, 1, 2)[slot] = token
    kv.register_prefix(seq_id, tokens)
    return hit


def keys_of(kv: PagedKVCache, seq_id: int, n: int) -> list[int]:
    table = kv.block_table(seq_id)
    return [int(kv.k_caches[0].view(-1, 1, 2)[table[t // BLOCK] * BLOCK + t % BLOCK, 0, 0]) for t in range(n)]


def test_a_shared_prefix_is_read_not_recomputed_and_rollback_leaves_it_alone():
    kv = cache()
    system = list(range(10, 18))  # two full blocks
    assert prefill(kv, 0, system + [1, 2, 3]) == 0
    assert prefill(kv, 1, system + [7, 7]) == 8  # both blocks shared
    assert kv.block_table(0)[:2] == kv.block_table(1)[:2]
    assert keys_of(kv, 1, 10) == system + [7, 7]
    kv.append_slots(1, 3)  # drafts past the prefix, rejected
    kv.truncate(1, 9)
    with pytest.raises(ValueError, match="registered prefix"):
        kv.truncate(1, 7)  # into a shared block: a bug, refused
    assert keys_of(kv, 0, 11) == system + [1, 2, 3]


def test_prompts_share_only_whole_blocks_before_their_last_token():
    kv = cache()
    prefill(kv, 0, list(range(8)))
    assert prefill(kv, 1, list(range(8))) == 4  # the last token's logits need a forward: 1 block
    assert prefill(kv, 2, list(range(9))) == 8
    assert prefill(kv, 3, [0, 1, 2, 9, 4, 5, 6, 7, 8]) == 0  # the first block differs: nothing after it


def test_freed_blocks_stay_cached_until_needed_and_the_oldest_goes_first():
    kv = cache(num_blocks=4)
    prefill(kv, 0, [1] * 8 + [0])  # blocks A, B keyed (+ one for the last token)
    kv.free(0)
    assert kv.allocator.num_free_blocks == 4 and kv.allocator.num_cached_blocks == 2
    prefill(kv, 1, [2] * 8 + [0])  # 3 blocks: the 2 free ones, then A (freed before B) evicted
    assert kv.allocator.num_cached_blocks == 1
    kv.free(1)
    assert prefill(kv, 2, [2] * 8 + [0]) == 8  # the last turn's blocks are still there
    kv.free(2)
    assert prefill(kv, 3, [1] * 8 + [0]) == 0  # A is gone, so B (after it) cannot match


def test_two_sequences_registering_the_same_prefix_keep_the_first_block():
    kv = cache()
    kv.add_sequence(0), kv.add_sequence(1)
    for s in (0, 1):  # prefilled side by side (one step): neither found the other's
        kv.append_slots(s, 5)
        kv.register_prefix(s, [3, 3, 3, 3, 4])
    assert prefill(kv, 2, [3, 3, 3, 3, 5]) == 4
    assert kv.block_table(2)[0] == kv.block_table(0)[0]
    free_before = kv.allocator.num_free_blocks
    for s in (0, 1, 2):
        kv.free(s)
    assert free_before == 3 and kv.allocator.num_free_blocks == kv.num_blocks  # all back, shared ones once


def test_without_prefix_caching_nothing_matches():
    kv = PagedKVCache(num_layers=1, num_blocks=8, block_size=BLOCK, num_kv_heads=1, head_dim=2)
    prefill(kv, 0, list(range(9)))
    assert prefill(kv, 1, list(range(9))) == 0
