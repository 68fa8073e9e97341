"""The RMSNorm folded into the skinny GEMMs (skinny_gemm_residual -> skinny_gemm_normed,
fused_forward's SPECD_FUSED_NORM=1), on CPU through Triton's interpreter (float16)."""

from __future__ import annotations

import pytest

from specd.models import skinny_gemm
from tests.models.interpreted import run_interpreted

pytestmark = pytest.mark.skipif(skinny_gemm.triton is None, reason="triton is a dependency (xgrammar pulls it)")


def test_producer_adds_the_residual_and_sums_squares_in_tree_order():
    """y = residual + the product rounded first (bit for bit what rms_norm's residual add of the
    plain product gives); ssq = the 16-column sums of y^2 in the pairwise tree's order."""
    out = run_interpreted("""
        import torch
        from specd.models.skinny_gemm import skinny_gemm, skinny_gemm_residual
        from specd.models.kernels.norm_act import rms_norm
        from specd.models.kernels.tree_sum import tree_sum_reference
        for seed, (m, n, k) in enumerate([(4, 128, 128), (17, 96, 64), (1, 32, 256)]):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(m, k, generator=g).half()
            w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
            res = torch.randn(m, n, generator=g).half()
            y, ssq = skinny_gemm_residual(x, w, res)
            assert y.shape == (m, n) and ssq.shape == (m, n // 16) and ssq.dtype == torch.float32
            plain = skinny_gemm(x, w)
            assert torch.equal(y, (res.float() + plain.float()).half())
            assert torch.equal(y, rms_norm(res, torch.ones(n).half(), 1e-5, plain)[0])
            assert torch.equal(ssq, tree_sum_reference((y.float() ** 2).view(m, n // 16, 16)))
        print("ok")
    """)
    assert out.strip().endswith("ok"), out


def test_consumer_norms_its_tiles_as_the_norm_kernel_rounds():
    """From the producer's sums: exactly the product of the tiles normed with that rstd (rounded
    as rms_norm rounds), within one rounding of rstd of rms_norm's own output; with the SwiGLU
    epilogue too."""
    out = run_interpreted("""
        import torch
        from specd.models.skinny_gemm import skinny_gemm, skinny_gemm_normed, skinny_gemm_residual, skinny_gemm_swiglu
        from specd.models.kernels.norm_act import rms_norm
        from specd.models.kernels.tree_sum import tree_sum_reference
        eps = 1e-5
        for seed, (m, k, n) in enumerate([(4, 128, 96), (20, 256, 64)]):
            g = torch.Generator().manual_seed(seed)
            x0 = torch.randn(m, 64, generator=g).half()
            w0 = (torch.randn(k, 64, generator=g) / 8).half()
            res = torch.randn(m, k, generator=g).half()
            x, ssq = skinny_gemm_residual(x0, w0, res)
            nw = (1 + 0.1 * torch.randn(k, generator=g)).half()
            w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
            gu = (torch.randn(2 * n, k, generator=g) / k ** 0.5).half()
            rstd = 1.0 / torch.sqrt(tree_sum_reference(ssq) / k + eps)
            h = ((x.float() * rstd[:, None]).half().float() * nw.float()).half()
            assert torch.equal(skinny_gemm_normed(x, w, ssq, nw, eps, False), skinny_gemm(h, w))
            assert torch.equal(skinny_gemm_normed(x, gu, ssq, nw, eps, True), skinny_gemm_swiglu(h, gu))
            _, h_kernel = rms_norm(x, nw, eps)
            diff = (h.float() - h_kernel.float()).abs() / h_kernel.float().abs().clamp_min(1e-3)
            print(m, k, n, diff.max().item(), (h != h_kernel).float().mean().item())
            assert diff.max() < 2e-3  # at most a rounding of fp16 apart
        print("ok")
    """)
    assert out.strip().endswith("ok"), out


def test_static_step_with_folded_norms_equals_the_pytorch_body():
    """SPECD_FUSED_NORM=1: the static step (two layers, aux hidden states of both) against PyTorch
    ops and F.linear, and against the default kernels; the folded ops really ran (counted)."""
    out = run_interpreted("""
        import dataclasses
        import os
        import torch
        from bench.step import arch_config, random_model
        from specd.messages import PytorchEngineConfig
        from specd.models import skinny_gemm
        from specd.models.base import SequenceChunk
        from specd.models.llama_runner import LlamaRunner
        calls = []
        for name in ("skinny_gemm_residual", "skinny_gemm_normed"):
            def counting(*a, _op=getattr(skinny_gemm, name), _name=name):
                calls.append(_name)
                return _op(*a)
            setattr(skinny_gemm, name, counting)
        cfg = dataclasses.replace(arch_config("small"), hidden_size=128, intermediate_size=256, head_dim=32)
        model = random_model(cfg, torch.float16, torch.device("cpu"))
        ec = PytorchEngineConfig(max_batch_size=2, block_size=16, num_gpu_blocks=16, session_len=64,
                                 device_type="cpu", dtype="float16")
        results = {}
        for label, gemm, kernels, fused in (("folded", "auto", "auto", "1"), ("kernels", "auto", "auto", "0"),
                                            ("torch", "torch", "off", "0")):
            os.environ["SPECD_FUSED_NORM"] = fused
            r = LlamaRunner(".", ec, model=model, config=cfg, use_static_path=True, compile_mode="0",
                            gemm=gemm, kernels=kernels)
            r.set_aux_hidden_layers([0, 1])
            for s, ctx in [(0, 9), (1, 21)]:
                r.add_sequence(s)
                r.kv_cache.append_slots(s, ctx)
            step = r.forward([SequenceChunk(0, [1, 2, 3]), SequenceChunk(1, [4, 5, 6])], want_aux_hidden=True)
            results[label] = (step.logits, step.aux_hidden_states)
            if label == "folded":  # 2 layers: o and down produce, gate_up and layer 1's qkv consume
                assert sorted(calls) == ["skinny_gemm_normed"] * 3 + ["skinny_gemm_residual"] * 4, calls
        for other in ("torch", "kernels"):
            for a, b in zip(results["folded"], results[other]):
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                print(other, tuple(a.shape), err)
                assert a.shape == b.shape and err < 5e-3, err
        print("ok")
    """)
    assert out.strip().endswith("ok"), out
