"""specd's Triton kernels (specd/models/kernels/, fused_forward.py) against their PyTorch twins,
on CPU through Triton's interpreter (float16: the interpreter has no bfloat16)."""

from __future__ import annotations

import pytest

from specd.models.kernels import paged_decode_attention
from tests.models.interpreted import SMALL_STEP, run_interpreted

pytestmark = pytest.mark.skipif(paged_decode_attention.triton is None, reason="triton (xgrammar pulls it)")


def test_split_kv_paged_attention_matches_the_gather_sdpa_twin():
    """Every split layout (one tile per program, many, a last split with no keys: target 12 gives
    3 splits of 2 of the 4 tiles) against the SDPA twin."""
    out = run_interpreted("""
        import torch
        from specd.models.kernels.paged_decode_attention import paged_decode_attention, num_splits
        from specd.models.static_attention import StaticAttentionMetadata, static_paged_attention
        g = torch.Generator().manual_seed(0)
        blocks, bs, hkv, d = 12, 16, 2, 16
        for hq, q_len, ctx, window, target in [(8, 4, [5, 30, 0], None, 264), (4, 1, [47, 3], None, 264),
                                               (8, 3, [40, 17], 9, 264), (8, 4, [33, 60], None, 1),
                                               (8, 4, [33, 60], None, 12)]:
            paged_decode_attention.__globals__["TARGET_PROGRAMS"] = target  # 1: one split per pair
            b = len(ctx)
            cache_k = torch.randn(blocks + 1, bs, hkv, d, generator=g).half()
            cache_v = torch.randn(blocks + 1, bs, hkv, d, generator=g).half()
            nb = 4
            perm = torch.randperm(blocks, generator=g)[: b * nb].view(b, nb)  # scattered blocks
            q = torch.randn(b * q_len, hq, d, generator=g).half()
            meta = StaticAttentionMetadata(ctx_lens=torch.tensor(ctx), block_tables=perm.clone(),
                                           slot_mapping=torch.zeros(b * q_len, dtype=torch.long),
                                           query_len=q_len, block_size=bs)
            ref = static_paged_attention(q.float(), cache_k.float(), cache_v.float(), meta, d ** -0.5, window)
            got = paged_decode_attention(q, cache_k, cache_v, meta.ctx_lens, meta.block_tables, q_len,
                                         d ** -0.5, window)
            assert got.shape == q.shape and torch.isfinite(got).all()
            err = ((got.float() - ref).norm() / ref.norm()).item()
            print(hq, q_len, ctx, window, num_splits(b, hkv, nb * bs, 16), err)
            assert err < 3e-3, err
        print("ok")
    """)
    assert out.strip().endswith("ok"), out


def test_rope_cache_write_and_norms_match_the_pytorch_modules():
    out = run_interpreted("""
        import torch
        from bench.step import arch_config, random_model
        from specd.models.attention import write_kv
        from specd.models.kernels.norm_act import rms_norm, silu_mul
        from specd.models.kernels.rope_cache import rope_and_cache_write
        from specd.models.llama import RMSNorm, apply_rotary
        torch.manual_seed(0)
        cfg = arch_config("small")
        model = random_model(cfg, torch.float16, torch.device("cpu"))
        attn = model.model.layers[0].self_attn
        t, hq, hkv, d = 6, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        x = torch.randn(t, cfg.hidden_size).half()
        qkv = attn.qkv_proj(x)
        positions = torch.tensor([0, 5, 6, 7, 100, 3])
        cos, sin = model.model.rotary_emb(positions, torch.float16)
        slots = torch.tensor([3, 17, 18, 19, 40, 2])
        caches = [torch.zeros(4, 16, hkv, d).half() for _ in range(4)]
        q_ref, k_ref, v_ref = attn.project(x, cos, sin)
        write_kv(caches[0], caches[1], k_ref, v_ref, slots)
        q = rope_and_cache_write(qkv, cos, sin, slots, caches[2], caches[3], hq, hkv)
        for a, b in [(q, q_ref), (caches[2], caches[0]), (caches[3], caches[1])]:
            assert torch.allclose(a.float(), b.float(), atol=2e-3, rtol=2e-3), (a - b).abs().max()
        assert torch.equal(caches[3], caches[1])  # v is copied, not computed
        norm = RMSNorm(cfg.hidden_size, 1e-5, torch.float16)
        with torch.no_grad():
            norm.weight.normal_()
        delta = torch.randn_like(x)
        res, normed = rms_norm(x, norm.weight, 1e-5, delta)
        assert torch.equal(res, x + delta)
        assert torch.allclose(normed.float(), norm(x + delta).float(), atol=4e-3, rtol=4e-3)
        same, normed0 = rms_norm(x, norm.weight, 1e-5)
        assert same is x and torch.allclose(normed0.float(), norm(x).float(), atol=4e-3, rtol=4e-3)
        gu = torch.randn(t, 2 * 1500).half()  # two column blocks, the second ragged
        gate, up = gu.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        assert torch.allclose(silu_mul(gu).float(), ref.float(), atol=2e-3, rtol=2e-3)
        print("ok")
    """)
    assert out.strip().endswith("ok"), out


def test_rms_norm_sums_split_k_partials_then_adds_as_the_unsplit_delta():
    """A delta of fp32 partials [S, T, H] gives bit for bit what the delta of their in-order fp32
    sum rounded to fp16 gives (what an unsplit product would store); rounding each partial first
    would not."""
    out = run_interpreted("""
        import torch
        from specd.models.kernels.norm_act import rms_norm
        g = torch.Generator().manual_seed(0)
        t, h = 5, 96  # H not a power of two: the masked tail
        x = torch.randn(t, h, generator=g).half()
        w = torch.randn(h, generator=g).half()
        big = torch.randn(3, t + 2, h, generator=g) * 7  # partials as a strided view: [S, T, H] of rows 1..T
        for splits in (2, 3):
            p = big[:splits, 1:t + 1]
            assert not p.is_contiguous()
            summed = p[0] + p[1] if splits == 2 else (p[0] + p[1]) + p[2]
            if splits == 2:
                assert torch.equal(summed, p.sum(0))
            res, normed = rms_norm(x, w, 1e-5, p)
            res_ref, normed_ref = rms_norm(x, w, 1e-5, summed.half())
            assert torch.equal(res, res_ref) and torch.equal(normed, normed_ref), splits
            assert torch.equal(res, x + summed.half())
            each_rounded = x + sum(q.half() for q in p)
            assert not torch.equal(res, each_rounded)  # the test tells the two roundings apart
        one, _ = rms_norm(x, w, 1e-5, big[:1, :t].contiguous())  # S = 1 partials: the plain delta
        assert torch.equal(one, x + big[0, :t].half())
        print("ok")
    """)
    assert out.strip().endswith("ok"), out


def test_fused_forward_with_split_k_gemms_equals_the_pytorch_body():
    """The static step with the skinny GEMMs ("auto"), o_proj and down_proj split-K into the
    norms (K = 128 and 256 here), vs PyTorch ops and F.linear."""
    out = run_interpreted("""
        from specd.models import skinny_gemm
        splits = []
        partials = skinny_gemm.skinny_gemm_partials
        def counting(x, w, s):
            splits.append((*w.shape, s))
            return partials(x, w, s)
        skinny_gemm.skinny_gemm_partials = counting
        results = {gemm: small_step(gemm, kernels) for gemm, kernels in (("auto", "auto"), ("torch", "off"))}
        # o_proj [128, 128] and down_proj [128, 256] of both layers, split in two, in the fused runner only
        assert splits == [(128, 128, 2), (128, 256, 2)] * 2, splits
        for a, b in zip(results["auto"], results["torch"]):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            print(tuple(a.shape), err)
            assert a.shape == b.shape and err < 5e-3, err
        print("ok")
    """, prelude=SMALL_STEP)
    assert out.strip().endswith("ok"), out


def test_fused_static_forward_equals_the_pytorch_body():
    """The whole static step (logits and EAGLE aux features) through the kernels vs PyTorch ops."""
    out = run_interpreted("""
        import torch
        from bench.step import arch_config, random_model
        from specd.messages import PytorchEngineConfig
        from specd.models.base import SequenceChunk
        from specd.models.llama_runner import LlamaRunner
        cfg = arch_config("small")
        model = random_model(cfg, torch.float16, torch.device("cpu"))
        ec = PytorchEngineConfig(max_batch_size=4, block_size=16, num_gpu_blocks=32, session_len=128,
                                 device_type="cpu", dtype="float16")
        results = {}
        for kernels in ("auto", "off"):
            r = LlamaRunner(".", ec, model=model, config=cfg, use_static_path=True,
                            gemm="torch", kernels=kernels)
            assert r.static.fused == (kernels == "auto")
            r.set_aux_hidden_layers([0, 1])
            prefills = []
            for s, ctx in [(0, 20), (1, 3), (2, 37)]:  # static prefills: Q 32, 64 (SDPA), 3 (the decode kernel)
                r.add_sequence(s)
                prefills.append(r.forward([SequenceChunk(s, [(s * 13 + j) % 500 for j in range(ctx)])]).logits)
            # a verify batch (ragged chunks: 4, 2, 4 tokens), then a decode step over what it wrote
            step1 = r.forward([SequenceChunk(0, [1, 2, 3, 4]), SequenceChunk(1, [5, 6]),
                               SequenceChunk(2, [7, 8, 9, 10])], want_aux_hidden=True)
            step2 = r.forward([SequenceChunk(0, [11]), SequenceChunk(1, [12]), SequenceChunk(2, [13])])
            assert r.static.num_static_forwards == 5  # the prefills are static too
            results[kernels] = (*prefills, step1.logits, step1.aux_hidden_states, step2.logits)
        for a, b in zip(results["auto"], results["off"]):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            print(tuple(a.shape), err)
            assert a.shape == b.shape and err < 5e-3, err
        print("ok")
    """)
    assert out.strip().endswith("ok"), out



def test_kernel_applies_only_to_blocks_of_whole_key_tiles(monkeypatch):
    """KV blocks under 16 tokens (a valid --cache-block-seq-len) leave the kernel for the PyTorch
    body: on CUDA the kernel's tile assertion failed the first forward (found on an H100)."""
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.zeros(1, 4, 16, dtype=torch.float16)
    for block_size, applies in [(1, False), (8, False), (16, True), (64, True), (256, True)]:
        cache_k = torch.zeros(3, block_size, 2, 16, dtype=torch.float16)
        assert paged_decode_attention.kernel_applies(q, cache_k) is applies, block_size
