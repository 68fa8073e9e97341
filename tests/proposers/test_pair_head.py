"""The shared pieces of the hidden-state heads, on hand-made tensors: BatchKV, weight fusion,
and the proposer's bookkeeping errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specd.proposers.base import DraftRequest
from specd.proposers.head_graphs import MAX_STATIC_QUERY as MAX_Q, HeadGraphs
from specd.proposers.head_kv import BLOCK, SCRATCH_BLOCK, BatchKV, HeadKVCache, StaticBatchKV
from specd.proposers.pair_head import PairHeadProposer, load_module_tensors
from specd.sampling_params import SamplingParams


def test_batch_kv_mask_gather_and_store():
    cache = HeadKVCache("cpu", initial_blocks=2)
    seq0, seq1 = cache.acquire(), cache.acquire()
    first = BatchKV(cache, [seq0], past_lens=[0], query_lens=[2])  # sequence 0 caches 2 positions
    first.update(torch.arange(2.0).view(1, 1, 2, 1), -torch.arange(2.0).view(1, 1, 2, 1))
    kv = BatchKV(cache, [seq0, seq1], past_lens=[2, 0], query_lens=[1, 3])
    want = torch.tensor([
        # seq 0: past 2 slots, 1 query (rows 1, 2 are padding: causal over new slots, no past)
        [[1, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
        # seq 1: no past, 3 causal queries
        [[0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
    ], dtype=torch.bool)
    assert torch.equal(kv.mask[:, 0], want)
    new_k = torch.arange(6.0).view(2, 1, 3, 1) + 10
    keys, values = kv.update(new_k, -new_k)
    assert keys.shape == (2, 1, 5, 1)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 10, 11, 12] and values[0, 0, :3, 0].tolist() == [0, -1, -10]
    assert keys[1, 0, 2:, 0].tolist() == [13, 14, 15]
    # stored: read back through a forward that brings one more position each
    after = BatchKV(cache, [seq0, seq1], past_lens=[3, 3], query_lens=[1, 1])
    keys, _ = after.update(torch.zeros(2, 1, 1, 1), torch.zeros(2, 1, 1, 1))
    assert keys[0, 0, :3, 0].tolist() == [0, 1, 10] and keys[1, 0, :3, 0].tolist() == [13, 14, 15]


def test_static_batch_kv_attends_and_stores_as_batch_kv():
    """Same past and new entries: the fixed-shape view (padded table, a padding row, a short
    chunk) gives each valid query the same attention and stores the same entries."""
    torch.manual_seed(0)
    heads, dim = 2, 4
    caches = [HeadKVCache("cpu", initial_blocks=8) for _ in range(2)]
    for cache in caches:  # the same past: 20 and 3 positions
        a, b = cache.acquire(), cache.acquire()
    past = [torch.randn(1, heads, n, dim) for n in (20, 3)]
    for cache in caches:
        for handle, p in zip((a, b), past):
            BatchKV(cache, [handle], [0], [p.shape[2]]).update(p, -p)
    new = torch.randn(2, heads, 3, dim)
    query = torch.randn(2, heads, 3, dim)
    eager = BatchKV(caches[0], [a, b], [20, 3], [3, 1])
    want = F.scaled_dot_product_attention(query, *eager.update(new, -new), attn_mask=eager.mask)
    width = 4  # blocks: more than the 2 the longest needs
    table = torch.full((3, width), SCRATCH_BLOCK)
    for row, (handle, n) in enumerate(((a, 23), (b, 4))):
        blocks = caches[1].reserve(handle, n)
        table[row, :len(blocks)] = torch.tensor(blocks)
    static = StaticBatchKV(caches[1], table, torch.tensor([20, 3, 0]), torch.tensor([3, 1, 0]), 3)
    padded = lambda t: torch.cat([t, torch.randn(1, heads, 3, dim)])  # noqa: E731 - a padding row
    got = F.scaled_dot_product_attention(padded(query), *static.update(padded(new), -padded(new)),
                                         attn_mask=static.mask)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1, :, :1], want[1, :, :1])  # sequence 1 brought one query
    for p, q in zip(caches[0].pools, caches[1].pools):  # stored alike, scratch aside
        torch.testing.assert_close(p[1:], q[1:])


def test_head_graphs_fall_back_and_recapture_after_the_pools_move():
    cache = HeadKVCache("cpu", initial_blocks=2)
    graphs = HeadGraphs(_EchoHead(), cache, torch.float32)
    handle = cache.acquire()
    assert graphs.forward([handle], [0], [MAX_Q + 1], [[0] * (MAX_Q + 1)], torch.zeros(MAX_Q + 1, 4)) is None
    BatchKV(cache, [handle], [0], [MAX_Q + 1]).update(torch.zeros(1, 1, MAX_Q + 1, 4))  # the eager path's
    generation = cache.generation
    out = graphs.forward([handle], [MAX_Q + 1], [2], [[1, 2]], torch.arange(8.0).view(2, 4))
    assert out.tolist() == [[4.0, 5.0, 6.0, 7.0]] and graphs.num_static_forwards == 1
    assert len(graphs._layouts) == 1
    graphs.forward([handle], [4 * BLOCK], [1], [[0]], torch.zeros(1, 4))  # 5 blocks: the pool of 4 grows
    assert cache.generation > generation and len(graphs._layouts) == 1  # the old layout dropped


def test_head_kv_cache_pages_grow_and_are_reused():
    cache = HeadKVCache("cpu", initial_blocks=3)  # blocks 1 and 2 (0 is the scratch block)
    a, b = cache.acquire(), cache.acquire()
    rows = lambda n, v: torch.full((1, 1, n, 1), float(v))  # noqa: E731
    BatchKV(cache, [a], [0], [BLOCK + 1]).update(rows(BLOCK + 1, 1))  # two blocks: the pool is full
    BatchKV(cache, [b], [0], [3]).update(rows(3, 2))  # a third block: the pool doubles, keeping a's
    assert cache.num_blocks == 6 and cache.pools[0].shape[0] == 6
    keys, = BatchKV(cache, [a, b], [BLOCK + 1, 3], [1, 1]).update(torch.zeros(2, 1, 1, 1))
    assert keys[0, 0, :BLOCK + 1, 0].unique().tolist() == [1.0] and keys[1, 0, :3, 0].tolist() == [2.0] * 3
    cache.release(a)  # its two blocks go back, and the next sequence takes them
    c = cache.acquire()
    assert len(cache.reserve(c, 2 * BLOCK)) == 2 and cache.num_blocks == 6


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 6, 4))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.zeros(2, 4, 3))  # [E, H, I]


def test_load_module_tensors_fuses_experts():
    module = nn.Module()
    module.mlp = nn.Module()
    module.mlp.experts = _Experts()
    per_expert = {}
    for e in range(2):
        per_expert[f"mlp.experts.{e}.gate_proj.weight"] = torch.full((3, 4), 10.0 * e + 1)
        per_expert[f"mlp.experts.{e}.up_proj.weight"] = torch.full((3, 4), 10.0 * e + 2)
        per_expert[f"mlp.experts.{e}.down_proj.weight"] = torch.full((4, 3), 10.0 * e + 3)
    load_module_tensors(module, dict(per_expert), "test")
    gate_up = module.mlp.experts.gate_up_proj
    assert gate_up[1, :3].unique().tolist() == [11.0] and gate_up[1, 3:].unique().tolist() == [12.0]
    assert module.mlp.experts.down_proj[0].unique().tolist() == [3.0]
    del per_expert["mlp.experts.1.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        load_module_tensors(module, per_expert, "test")
    with pytest.raises(KeyError, match="unexpected"):
        load_module_tensors(module, {"mlp.experts.gate_up_proj": gate_up.detach(),
                                     "mlp.experts.down_proj": torch.zeros(2, 4, 3),
                                     "stray.weight": torch.zeros(1)}, "test")


class _EchoHead(nn.Module):
    """A head without attention parameters: outputs its hidden input, logits favour token 7."""

    def project_target(self, rows):
        return rows

    def forward(self, ids, hidden, positions, kv):
        kv.update(hidden[:, None], hidden[:, None])  # one cached quantity per pair
        return hidden

    def logits(self, hidden):
        out = torch.zeros(hidden.shape[0], 16)
        out[:, 7] = 1.0
        return out


def test_proposer_bookkeeping():
    proposer = PairHeadProposer(_EchoHead(), "cpu", torch.float32)
    proposer.open(0, SamplingParams())
    out = proposer.propose([DraftRequest(0, [1, 2, 3], torch.zeros(2, 4), 3)])[0]
    assert out.token_ids.tolist() == [7, 7, 7] and out.probs is None
    assert proposer._seqs[0].num_cached == 2 and proposer._seqs[0].kv_len == 4
    # no new tokens: the speculative entries are dropped and the last committed output reused
    out = proposer.propose([DraftRequest(0, [], None, 1)])[0]
    assert out.token_ids.tolist() == [7] and proposer._seqs[0].kv_len == 2
    with pytest.raises(ValueError, match="hidden rows"):
        proposer.propose([DraftRequest(0, [5, 6], torch.zeros(1, 4), 1)])
    proposer.close(0)
    assert 0 not in proposer._seqs


def test_the_fixed_shapes_take_batches_up_to_max_batch_size():
    wide = PairHeadProposer(_EchoHead(), "cpu", torch.float32, static_steps=True, max_batch_size=200)
    assert wide.graphs.buckets[-1] == 200 and wide.graphs.layout([0] * 150, [1] * 150) == (200, 1, 1)
    default = PairHeadProposer(_EchoHead(), "cpu", torch.float32, static_steps=True)
    assert default.graphs.layout([0] * 150, [1] * 150) is None  # the eager path takes it
    assert PairHeadProposer(_EchoHead(), "cpu", torch.float32).graphs is None  # CPU: eager by default


def test_block_tables_follow_reserve_release_and_growth():
    """The host array behind the fixed-shape forwards' tables: each handle's blocks, scratch past
    them; a released handle's row is cleared and reused; rows and columns grow as needed."""
    cache = HeadKVCache("cpu", initial_blocks=64)
    handles = [cache.acquire() for _ in range(20)]  # past the array's first 16 rows
    for i, h in enumerate(handles):
        cache.reserve(h, (i + 1) * BLOCK)  # handle i holds i + 1 blocks; 20 is past 16 columns
    tables = cache.block_tables(handles, 24)
    for i, h in enumerate(handles):
        assert tables[i, :i + 1].tolist() == cache.reserve(h, 0)
        assert (tables[i, i + 1:] == SCRATCH_BLOCK).all()
    assert cache.block_tables([handles[19]], 4).tolist() == [cache.reserve(handles[19], 0)[:4]]
    cache.release(handles[3])
    again = cache.acquire()
    assert again == handles[3] and (cache.block_tables([again], 24) == SCRATCH_BLOCK).all()
    cache.reserve(again, 1)
    assert cache.block_tables([again], 2).tolist() == [[cache.reserve(again, 0)[0], SCRATCH_BLOCK]]


def test_fixed_shape_forwards_refuse_blocks_smaller_than_their_query_rows():
    """A padding row's entries go to slots 0..Q-1 of the scratch block: 8-position blocks would
    spill them into a sequence's block."""
    with pytest.raises(ValueError, match="kv_block_size: .* at least 16 positions, got 8"):
        PairHeadProposer(_EchoHead(), "cpu", torch.float32, static_steps=True, kv_block_size=8)
    assert PairHeadProposer(_EchoHead(), "cpu", torch.float32, static_steps=False, kv_block_size=8).graphs is None
