"""The PyTorch paged-attention twin against dense attention on contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

from specd.models.attention import AttentionMetadata, paged_attention, torch_paged_attention, write_kv
from specd.models.kv_cache import PagedKVCache


def dense_reference(q, k, v, query_len, window):
    """q: [q, Hq, D] at the end of a context k, v: [s, Hkv, D]."""
    s, hq, d = k.shape[0], q.shape[1], q.shape[2]
    k = k.repeat_interleave(hq // k.shape[1], dim=1)
    v = v.repeat_interleave(hq // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    pos = torch.arange(s - query_len, s)[:, None]
    keys = torch.arange(s)[None, :]
    allowed = keys <= pos
    if window is not None:
        allowed &= keys > pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 3])
def test_paged_matches_dense(window):
    torch.manual_seed(0)
    hq, hkv, d, bs = 4, 2, 8, 4
    cache = PagedKVCache(1, num_blocks=16, block_size=bs, num_kv_heads=hkv, head_dim=d)
    # Scramble the free list so block tables are not contiguous.
    cache.allocator._free = type(cache.allocator._free)(torch.randperm(16).tolist())
    contexts = {0: 9, 1: 3, 2: 14}  # cached tokens before this step
    query_lens = {0: 5, 1: 1, 2: 2}
    full_k, full_v = {}, {}
    for s, n in contexts.items():
        cache.add_sequence(s)
        full_k[s] = torch.randn(n + query_lens[s], hkv, d)
        full_v[s] = torch.randn(n + query_lens[s], hkv, d)
        slots = torch.tensor(cache.append_slots(s, n))
        write_kv(cache.k_caches[0], cache.v_caches[0], full_k[s][:n], full_v[s][:n], slots)
    seqs = list(contexts)
    slots = []
    for s in seqs:
        slots += cache.append_slots(s, query_lens[s])
    meta = AttentionMetadata.build(
        [query_lens[s] for s in seqs], [contexts[s] + query_lens[s] for s in seqs],
        cache.block_tables(seqs), slots, bs, torch.device("cpu"))
    new_k = torch.cat([full_k[s][contexts[s]:] for s in seqs])
    new_v = torch.cat([full_v[s][contexts[s]:] for s in seqs])
    write_kv(cache.k_caches[0], cache.v_caches[0], new_k, new_v, meta.slot_mapping)
    q = torch.randn(sum(query_lens.values()), hq, d)
    out = paged_attention(q, cache.k_caches[0], cache.v_caches[0], meta, d ** -0.5, window)
    assert out.shape == q.shape
    start = 0
    for s in seqs:
        n = query_lens[s]
        ref = dense_reference(q[start:start + n], full_k[s], full_v[s], n, window)
        torch.testing.assert_close(out[start:start + n], ref, atol=1e-5, rtol=1e-5)
        start += n
    assert meta.cu_seqlens_k.tolist() == [0, 14, 18, 34]
    assert torch.equal(out, torch_paged_attention(q, cache.k_caches[0], cache.v_caches[0], meta,
                                                  d ** -0.5, window))


def test_metadata_validation():
    with pytest.raises(ValueError):
        AttentionMetadata.build([3], [2], torch.zeros(1, 1), [0, 1, 2], 4, torch.device("cpu"))
