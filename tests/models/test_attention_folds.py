"""The attention kernel's opt-in folds (kernels/paged_decode_attention.py): SPECD_ATTN_ROPE=1 (RoPE
and the cache write inside the attention kernel) and SPECD_ATTN_MERGE=1 (the split merge by each
pair's last program) give the bits the separate kernels give, on CPU through Triton's interpreter
(float16: the interpreter has no bfloat16)."""

from __future__ import annotations

import pytest

from specd.models.kernels import paged_decode_attention
from tests.models.interpreted import run_interpreted

pytestmark = pytest.mark.skipif(paged_decode_attention.triton is None, reason="triton (xgrammar pulls it)")

# A static layout as cuda_graphs.StaticForward fills it: layout(ctx, real, q_len, nb) -> (ctx_lens,
# block tables, slot_mapping); slot b holds real[b] new tokens (the rest padding rows), ctx None is a
# padding slot (ctx 0, block table all scratch); padding rows write the scratch block.
LAYOUT = """
    import os
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


def test_merge_in_the_partials_kernel_equals_the_combine_kernel_and_rezeroes_its_counters():
    """Bit for bit (several splits, one split: the direct path, the rope fold too), twice in a row
    on the same counters, which end at zero."""
    out = run_interpreted(LAYOUT + """
    for hq, q_len, ctx, nb, window, target in [(8, 4, [13, 30, 0], 4, None, 264), (4, 1, [47, 3], 4, None, 12),
                                               (8, 3, [40, 17], 4, 9, 264), (8, 4, [33, 60], 4, None, 1)]:
        pda.TARGET_PROGRAMS = target
        b = len(ctx)
        ctx_t, tables, slots, pos = layout(ctx, [q_len] * b, q_len, nb)
        qkv = torch.randn(b * q_len, (hq + 2 * hkv) * d, generator=g).half()
        cos, sin = tables_for(pos)
        cache = [torch.randn(blocks + 1, bs, hkv, d, generator=g).half() for _ in range(2)]
        q = rope_and_cache_write(qkv, cos, sin, slots, *cache, hq, hkv)
        owner = type("Owner", (), {})()
        results = {}
        for merge in ("0", "1"):
            os.environ[pda.MERGE_ENV] = merge
            for run in range(2):
                results[merge, run] = pda.paged_decode_attention(q, *cache, ctx_t, tables, q_len, d ** -0.5,
                                                                 window, counter_owner=owner)
            k, v = cache[0].clone(), cache[1].clone()
            results[merge, "rope"] = pda.rope_paged_decode_attention(
                qkv, cos, sin, slots, k, v, ctx_t, tables, q_len, hq, d ** -0.5, window, counter_owner=owner)
        ref = results["0", 0]
        assert all(torch.equal(r, ref) for r in results.values()), ctx
        counters = pda.merge_counters(owner, torch.device("cpu"), b * hkv)
        assert counters.dtype == torch.int32 and not counters.any(), counters
        print(q_len, ctx, target, pda.num_splits(b, hkv, nb * bs, 16), "equal")
    print("ok")
    """)
    assert out.strip().endswith("ok"), out


def test_merge_counters_are_one_zeroed_buffer_per_owner_and_size():
    owner, other = type("Owner", (), {})(), type("Owner", (), {})()
    cpu = paged_decode_attention.merge_counters(owner, "cpu", 8)
    assert cpu.dtype == paged_decode_attention.torch.int32 and cpu.shape == (8,) and not cpu.any()
    assert paged_decode_attention.merge_counters(owner, "cpu", 8) is cpu
    assert paged_decode_attention.merge_counters(other, "cpu", 8) is not cpu  # another model's: its own
    assert paged_decode_attention.merge_counters(owner, "cpu", 16) is not cpu  # the first stays (graphs keep it)
    assert paged_decode_attention.merge_counters(None, "cpu", 8) is not cpu
    from specd.models.kernels.arrival_counters import arrival_counters
    assert arrival_counters(owner, "attention merge", "cpu", 8) is cpu
    assert arrival_counters(owner, "another kernel", "cpu", 8) is not cpu  # a purpose of its own


def test_fused_static_forward_with_both_attention_folds_equals_the_pytorch_body():
    """The whole static step with SPECD_ATTN_ROPE=1 and SPECD_ATTN_MERGE=1: the same bits as the
    kernels without them, and the PyTorch body's logits within fp16 tolerance."""
    out = run_interpreted("""
        import os
        import torch
        from bench.step import arch_config, random_model
        from specd.messages import PytorchEngineConfig
        from specd.models.base import SequenceChunk
        from specd.models.kernels import paged_decode_attention as pda
        from specd.models.llama_runner import LlamaRunner
        cfg = arch_config("small")
        model = random_model(cfg, torch.float16, torch.device("cpu"))
        ec = PytorchEngineConfig(max_batch_size=4, block_size=16, num_gpu_blocks=32, session_len=128,
                                 device_type="cpu", dtype="float16")
        from specd.models.kernels import rope_cache
        launches = {"rope": 0, "combine": 0}
        rope_write, combine = rope_cache.rope_and_cache_write, pda._combine_kernel
        def counting_rope(*args):
            launches["rope"] += 1
            return rope_write(*args)
        class CountingCombine:
            def __getitem__(self, grid):
                launches["combine"] += 1
                return combine[grid]
        rope_cache.rope_and_cache_write, pda._combine_kernel = counting_rope, CountingCombine()
        results = {}
        for name, kernels, folds in (("folded", "auto", "1"), ("kernels", "auto", "0"), ("torch", "off", "0")):
            os.environ[pda.ROPE_ENV] = os.environ[pda.MERGE_ENV] = folds
            r = LlamaRunner(".", ec, model=model, config=cfg, use_static_path=True, compile_mode="0",
                            gemm="torch", kernels=kernels)
            assert r.static.fused == (kernels == "auto")
            r.set_aux_hidden_layers([0, 1])
            for s, ctx in [(0, 14), (1, 20)]:  # static prefills: Q 16 (the decode kernel), 32 (SDPA)
                r.add_sequence(s)
                r.forward([SequenceChunk(s, [(s * 13 + j) % 500 for j in range(ctx)])])
            # a verify batch across the first 16-key chunk's end (14..17), ragged (4, 2 tokens), then a decode step
            step1 = r.forward([SequenceChunk(0, [1, 2, 3, 4]), SequenceChunk(1, [5, 6])], want_aux_hidden=True)
            step2 = r.forward([SequenceChunk(0, [11]), SequenceChunk(1, [12])])
            results[name] = (step1.logits, step1.aux_hidden_states, step2.logits)
            if name == "folded":  # the rope kernel for the SDPA prefill only, never the combine
                assert launches == {"rope": cfg.num_hidden_layers, "combine": 0}, launches
                counters = pda.merge_counters(r.kv_cache, torch.device("cpu"), 2 * cfg.num_key_value_heads)
                assert not counters.any(), counters
        for a, b, c in zip(results["folded"], results["kernels"], results["torch"]):
            assert torch.equal(a, b)
            err = ((a.float() - c.float()).norm() / c.float().norm()).item()
            print(tuple(a.shape), err)
            assert a.shape == c.shape and err < 5e-3, err
        print("ok")
    """)
    assert out.strip().endswith("ok"), out
