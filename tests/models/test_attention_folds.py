"""RoPE and the cache write folded into the attention kernel (kernels/paged_decode_attention.py,
rope_paged_decode_attention: the verify step's) give the bits rope_cache's kernel and then the
plain attention kernel give, on CPU through Triton's interpreter (float16: the interpreter has no
bfloat16)."""

from __future__ import annotations

import pytest

from specd.models.kernels import paged_decode_attention
from tests.models.interpreted import run_interpreted

pytestmark = pytest.mark.skipif(paged_decode_attention.triton is None, reason="triton (xgrammar pulls it)")

# A static layout as cuda_graphs.StaticForward fills it: layout(ctx, real, q_len, nb) -> (ctx_lens,
# block tables, slot_mapping); slot b holds real[b] new tokens (the rest padding rows), ctx None is a
# padding slot (ctx 0, block table all scratch); padding rows write the scratch block.
LAYOUT = """
    import torch
    from specd.models.kernels import paged_decode_attention as pda
    from specd.models.kernels.rope_cache import rope_and_cache_write
    g = torch.Generator().manual_seed(0)
    blocks, bs, hkv, d = 12, 16, 2, 16
    scratch = blocks
    def layout(ctx, real, q_len, nb):
        b = len(ctx)
        tables = torch.randperm(blocks, generator=g)[: b * nb].view(b, nb)  # scattered blocks
        tables[torch.tensor([c is None for c in ctx])] = scratch
        ctx_t = torch.tensor([c or 0 for c in ctx])
        i = torch.arange(q_len)
        pos = ctx_t[:, None] + i
        slots = tables.gather(1, (pos // bs).clamp(max=nb - 1)) * bs + pos % bs
        pad = (i[None, :] >= torch.tensor(real)[:, None]) | (pos >= nb * bs)  # past the table: scratch too
        slots = torch.where(pad, scratch * bs + i % bs, slots).flatten()  # as cuda_graphs' blank
        return ctx_t, tables, slots, pos.flatten()
    def tables_for(pos):  # RotaryEmbedding's: cos, signed sin [T, D]
        ang = pos[:, None].float() * (10000.0 ** (-torch.arange(d // 2).float() / (d // 2)))
        ang = torch.cat([ang, ang], dim=-1)
        sin = ang.sin()
        return ang.cos().half(), torch.cat([-sin[:, : d // 2], sin[:, d // 2:]], dim=-1).half()
"""


def test_rope_folded_into_attention_writes_and_attends_as_rope_cache_then_attention():
    """Output and caches bit for bit: new tokens across a chunk boundary (16-key chunks at target
    264, 32 at 12), one split (target 1), a decode, a window, padding rows and a padding slot, and
    new tokens past the block table's end (the last split writes them)."""
    out = run_interpreted(LAYOUT + """
    for hq, q_len, ctx, real, nb, window, target in [
            (8, 4, [13, 30, None], [4, 2, 0], 4, None, 264), (4, 1, [47, 31], [1, 1], 4, None, 264),
            (8, 3, [30, 14], [3, 3], 4, 9, 12), (8, 4, [29, 60], [4, 4], 4, None, 1),
            (4, 4, [30], [4], 2, None, 12)]:  # the last: positions 32, 33 past the 2 blocks
        pda.TARGET_PROGRAMS = target
        b = len(ctx)
        ctx_t, tables, slots, pos = layout(ctx, real, q_len, nb)
        qkv = torch.randn(b * q_len, (hq + 2 * hkv) * d, generator=g).half()
        cos, sin = tables_for(pos)
        cache = [torch.randn(blocks + 1, bs, hkv, d, generator=g).half() for _ in range(2)]
        ref_k, ref_v = cache[0].clone(), cache[1].clone()
        q = rope_and_cache_write(qkv, cos, sin, slots, ref_k, ref_v, hq, hkv)
        ref = pda.paged_decode_attention(q, ref_k, ref_v, ctx_t, tables, q_len, d ** -0.5, window)
        k, v = cache[0].clone(), cache[1].clone()
        got = pda.rope_paged_decode_attention(qkv, cos, sin, slots, k, v, ctx_t, tables, q_len, hq,
                                              d ** -0.5, window)
        rows = (torch.arange(q_len)[None, :] < torch.tensor(real)[:, None]).flatten()
        assert torch.equal(got[rows], ref[rows]), (ctx, (got[rows].float() - ref[rows].float()).abs().max())
        # real blocks bit for bit; the scratch block takes the padding rows' writes, several to a
        # slot, in whichever order the programs run (its contents are never read by a real row)
        assert torch.equal(k[:scratch], ref_k[:scratch]) and torch.equal(v[:scratch], ref_v[:scratch]), ctx
        assert not torch.equal(k[:scratch], cache[0][:scratch])  # the test writes something
        if nb == 2:
            assert torch.equal(k, ref_k) and torch.equal(v, ref_v)  # the tokens past the table too
        print(q_len, ctx, target, pda.num_splits(b, hkv, nb * bs, 16), "equal")
    print("ok")
    """)
    assert out.strip().endswith("ok"), out
