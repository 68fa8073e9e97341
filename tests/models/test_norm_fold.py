"""The norm folded into the GEMMs around it (SPECD_NORM_FOLD=1, norm_fold.py) against the norm
kernel between plain GEMMs, on CPU through Triton's interpreter (float16: no bfloat16 there)."""

from __future__ import annotations

import pytest
import torch

from specd.models.kernels import paged_decode_attention
from tests.models.interpreted import SMALL_STEP, run_interpreted

pytestmark = pytest.mark.skipif(paged_decode_attention.triton is None, reason="triton (xgrammar pulls it)")


def test_residual_product_then_row_scaled_product_equal_the_norm_kernel_path():
    """o_proj split-K with the residual add finished by its last programs, then gate/up (and a plain
    product) scaled by the rows' 1 / rms: the residual bit for bit as the norm kernel's, the squares'
    sums and r * w exact, the products as close to float64 as the norm kernel path's; the counters
    zero again, and a second call the same bits. At 4 rows (bucket 16) and 20 (bucket 32)."""
    out = run_interpreted("""
        import os
        from types import SimpleNamespace
        import torch
        os.environ["SPECD_NORM_FOLD"] = "1"
        from specd.models import norm_fold, skinny_gemm
        from specd.models.kernels import norm_act
        from specd.models.kernels.arrival_counters import arrival_counters
        from specd.models.linear import gemm_backend
        gemm_backend("auto").__enter__()  # what a runner holds around its forward
        g = torch.Generator().manual_seed(0)
        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).half()
        hidden, k, inter, eps = 128, 256, 192, 1e-5
        o_proj = SimpleNamespace(weight=rand(hidden, k, scale=0.05), bias=None)
        gate_up = SimpleNamespace(weight=rand(2 * inter, hidden, scale=0.05), bias=None)
        qkv = SimpleNamespace(weight=rand(192, hidden, scale=0.05), bias=None)
        norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).half()
        owner = type("Owner", (), {})()
        for m in (4, 20):
            x, residual = rand(m, k), rand(m, hidden, scale=3.0)
            assert norm_fold.applies(x, o_proj, gate_up)
            splits = skinny_gemm.split_k_for(hidden, k)
            assert splits == 2
            r_ref, h_ref = norm_act.rms_norm(residual, norm_w, eps, skinny_gemm.skinny_gemm_partials(x, o_proj.weight, splits))
            folded = norm_fold.residual_product(o_proj, x, residual, norm_w, owner)
            assert torch.equal(folded.residual, r_ref)
            rf = folded.residual.float()
            assert torch.equal(folded.normed, (rf * norm_w.float()).half())
            want_sq = (rf * rf).view(m, hidden // 16, 16).sum(-1).t()
            assert folded.squares.shape == (hidden // 16, m)
            assert torch.allclose(folded.squares, want_sq, rtol=1e-6, atol=0), (folded.squares - want_sq).abs().max()
            counters = arrival_counters(owner, "residual product", x.device, hidden // 16)
            assert not counters.any()
            again = norm_fold.residual_product(o_proj, x, residual, norm_w, owner)
            assert all(torch.equal(a, b) for a, b in zip(
                (folded.residual, folded.normed, folded.squares), (again.residual, again.normed, again.squares)))
            # float64 truth from the same residual
            r64 = r_ref.double()
            n64 = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()
            for proj, swiglu in ((qkv, False), (gate_up, True)):
                got = norm_fold.scaled_product(proj, folded, eps, swiglu=swiglu).double()
                if swiglu:
                    ref = norm_act.silu_mul(skinny_gemm.skinny_gemm(h_ref, proj.weight)).double()
                    y = n64 @ proj.weight.double().t()
                    truth = torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
                else:
                    ref = skinny_gemm.skinny_gemm(h_ref, proj.weight).double()
                    truth = n64 @ proj.weight.double().t()
                err_fold = ((got - truth).norm() / truth.norm()).item()
                err_ref = ((ref - truth).norm() / truth.norm()).item()
                print(m, swiglu, "fold", err_fold, "norm kernel", err_ref)
                assert got.shape == ref.shape and err_fold < 2e-3 and err_fold < 2 * err_ref + 1e-4
        print("ok")
    """)
    print(out)
    assert out.strip().endswith("ok"), out


def test_fused_forward_with_the_norm_folded_equals_the_pytorch_body():
    """The whole static step with SPECD_NORM_FOLD=1: every norm but the first and the final one
    folded (3 residual products over 2 layers), logits and aux features within fp16 rounding of
    PyTorch ops and F.linear."""
    out = run_interpreted("""
        import os
        os.environ["SPECD_NORM_FOLD"] = "1"
        from specd.models import norm_fold
        calls = []
        product = norm_fold.skinny_gemm_residual
        def counting(x, w, *rest):
            calls.append(tuple(w.shape))
            return product(x, w, *rest)
        norm_fold.skinny_gemm_residual = counting
        results = {gemm: small_step(gemm, kernels) for gemm, kernels in (("auto", "auto"), ("torch", "off"))}
        # o_proj [128, 128] of both layers, down_proj [128, 256] of the first (the last feeds the final norm)
        assert calls == [(128, 128), (128, 256), (128, 128)], calls
        for a, b in zip(results["auto"], results["torch"]):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            print(tuple(a.shape), err)
            assert a.shape == b.shape and err < 5e-3, err
        print("ok")
    """, prelude=SMALL_STEP)
    print(out)
    assert out.strip().endswith("ok"), out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the programs race only on a GPU")
def test_residual_product_is_race_free_at_the_8b_shapes_on_cuda(monkeypatch):
    """At o_proj's and down_proj's 8B shapes (128+ column blocks, 2 splits, both programs of a block
    racing for the last arrival), 50 calls: the residual bit for bit the norm kernel's every time,
    the squares and r * w the same bits every time, the counters zero after each."""
    from specd.models import norm_fold, skinny_gemm
    from specd.models.kernels import norm_act
    from specd.models.kernels.arrival_counters import arrival_counters
    from specd.models.linear import gemm_backend

    monkeypatch.setenv(norm_fold.NORM_FOLD_ENV, "1")  # off by default: applies() says no without it
    g = torch.Generator(device="cuda").manual_seed(0)
    owner = type("Owner", (), {})()
    hidden = 4096
    with gemm_backend("auto"):
        for m, k in ((4, 4096), (20, 14336)):
            proj = type("Proj", (), {"weight": (torch.randn(hidden, k, generator=g, device="cuda") * 0.02).bfloat16(),
                                     "bias": None})()
            nxt = type("Proj", (), {"weight": torch.zeros(6144, hidden, device="cuda", dtype=torch.bfloat16),
                                    "bias": None})()
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            residual = (torch.randn(m, hidden, generator=g, device="cuda") * 3).bfloat16()
            norm_w = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).bfloat16()
            assert norm_fold.applies(x, proj, nxt)
            partials = skinny_gemm.skinny_gemm_partials(x, proj.weight, skinny_gemm.split_k_for(hidden, k))
            want, _ = norm_act.rms_norm(residual, norm_w, 1e-5, partials)
            first = norm_fold.residual_product(proj, x, residual, norm_w, owner)
            counters = arrival_counters(owner, "residual product", x.device, hidden // 16)
            for _ in range(50):
                got = norm_fold.residual_product(proj, x, residual, norm_w, owner)
                assert torch.equal(got.residual, want)
                assert torch.equal(got.squares, first.squares) and torch.equal(got.normed, first.normed)
                assert not counters.any()
