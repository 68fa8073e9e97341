"""The RMSNorm split across a producer GEMM's epilogue and its consumer's (norm_epilogue.py), on CPU
through Triton's interpreter (float16: the interpreter has no bfloat16)."""

from __future__ import annotations

import pytest

from specd.models import skinny_gemm
from tests.models.interpreted import run_interpreted

pytestmark = pytest.mark.skipif(skinny_gemm.triton is None, reason="triton is a dependency (xgrammar pulls it)")


def test_split_norm_matches_the_norm_kernel_then_the_product():
    """Producer unsplit and split-K 2 and 3 (the partials summed by whichever program counts last),
    consumer plain and SwiGLU: the residual equals the norm kernel's bit for bit; h is the residual
    times the weight; the squares are the residual's; the consumer's product is within fp16
    rounding of float64's norm-then-product (as close as the norm kernel + product are); the
    counters are back at zero after each launch; a row's results do not depend on the other rows;
    and a second launch gives the same bits."""
    out = run_interpreted("""
        import torch
        from specd.models import skinny_gemm
        from specd.models.kernels.norm_act import rms_norm, silu_mul
        from specd.models.norm_epilogue import counters_for, residual_norm_product, row_scaled_product, skinny_gemm_residual_norm

        def rel(a, b):
            return ((a.double() - b.double()).norm() / b.double().norm()).item()

        for seed, (m, k_in, hidden, n_out, splits, swiglu) in enumerate([
                (4, 128, 64, 48, 2, False), (1, 192, 192, 64, 3, True), (5, 128, 128, 32, 1, False),
                (17, 256, 64, 40, 2, True)]):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(m, k_in, generator=g).half()
            w = (torch.randn(hidden, k_in, generator=g) / k_in ** 0.5).half()
            residual = (torch.randn(m, hidden, generator=g) * 2).half()
            nw = (1 + 0.3 * torch.randn(hidden, generator=g)).half()
            w2 = (torch.randn(n_out, hidden, generator=g) / hidden ** 0.5).half()
            counters = counters_for(w)
            r, h, ss = skinny_gemm_residual_norm(x, w, splits, residual, nw, counters)
            assert counters.eq(0).all()
            # the reference: the same product as a delta (split the same way) into the norm kernel
            delta = skinny_gemm.skinny_gemm_partials(x, w, splits) if splits > 1 else skinny_gemm.skinny_gemm(x, w)
            r_ref, normed = rms_norm(residual, nw, 1e-5, delta)
            assert torch.equal(r, r_ref), (m, splits)
            assert torch.equal(h, (r.float() * nw.float()).half())
            sq = r.double().pow(2).view(m, hidden // 16, 16).sum(-1).T
            assert ss.shape == (hidden // 16, m) and torch.allclose(ss.double(), sq, rtol=1e-6)
            y = row_scaled_product(h, ss, 1e-5, w2, swiglu)
            exact = r.double() / (r.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * nw.double() @ w2.double().T
            unfused = skinny_gemm.skinny_gemm(normed, w2)
            if swiglu:
                gate, up = exact.chunk(2, dim=-1)
                exact = gate * torch.sigmoid(gate) * up
                unfused = silu_mul(unfused)
            err, err_unfused = rel(y, exact), rel(unfused, exact)
            print(m, splits, swiglu, err, err_unfused)
            assert y.shape == unfused.shape and err < 2e-3 and err < 2 * err_unfused + 5e-4, (err, err_unfused)
            r2, h2, ss2 = skinny_gemm_residual_norm(x, w, splits, residual, nw, counters)
            assert torch.equal(r2, r) and torch.equal(h2, h) and torch.equal(ss2, ss) and counters.eq(0).all()
            r1, h1, ss1 = skinny_gemm_residual_norm(x[:1], w, splits, residual[:1], nw, counters)
            assert torch.equal(r1, r[:1]) and torch.equal(h1, h[:1]) and torch.equal(ss1, ss[:, :1])
            assert torch.equal(row_scaled_product(h1, ss1, 1e-5, w2, swiglu), y[:1])
        print("ok")
    """)
    assert out.strip().endswith("ok"), out


def test_static_forward_with_split_norms_equals_the_pytorch_body():
    """SPECD_NORM_EPILOGUE=1: in the fused static step the norms after o_proj and between layers
    run in the GEMMs' epilogues (o_proj and down_proj split-K here, K = 128 and 256), all but the
    first layer's input norm and the final norm; logits and EAGLE aux features (the residuals)
    match the PyTorch body, twice in a row (the counters reset themselves)."""
    out = run_interpreted("""
        import dataclasses, os
        import torch
        from bench.step import arch_config, random_model
        from specd.messages import PytorchEngineConfig
        from specd.models import norm_epilogue
        from specd.models.base import SequenceChunk
        from specd.models.llama_runner import LlamaRunner
        calls = []
        product = norm_epilogue.skinny_gemm_residual_norm
        def counting(x, w, splits, *rest):
            calls.append((*w.shape, splits))
            return product(x, w, splits, *rest)
        norm_epilogue.skinny_gemm_residual_norm = counting
        cfg = dataclasses.replace(arch_config("small"), hidden_size=128, intermediate_size=256, head_dim=32)
        model = random_model(cfg, torch.float16, torch.device("cpu"))
        ec = PytorchEngineConfig(max_batch_size=2, block_size=16, num_gpu_blocks=16, session_len=64,
                                 device_type="cpu", dtype="float16")
        results = {}
        for gemm, kernels, split in (("auto", "auto", "1"), ("torch", "off", "0")):
            os.environ[norm_epilogue.NORM_EPILOGUE_ENV] = split
            r = LlamaRunner(".", ec, model=model, config=cfg, use_static_path=True, compile_mode="0",
                            gemm=gemm, kernels=kernels)
            r.set_aux_hidden_layers([0, 1])
            for s, ctx in [(0, 9), (1, 21)]:
                r.add_sequence(s)
                r.kv_cache.append_slots(s, ctx)
            steps = [r.forward([SequenceChunk(0, [1, 2, 3]), SequenceChunk(1, [4, 5, 6])], want_aux_hidden=True)
                     for _ in range(2)]
            results[gemm] = [(st.logits, st.aux_hidden_states) for st in steps]
        # two layers: o_proj [128, 128] of both, down_proj [128, 256] of the first only, each twice
        assert calls == [(128, 128, 2), (128, 256, 2), (128, 128, 2)] * 2, calls
        for got, want in zip(results["auto"], results["torch"]):
            for a, b in zip(got, want):
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                print(tuple(a.shape), err)
                assert a.shape == b.shape and err < 5e-3, err
        print("ok")
    """)
    assert out.strip().endswith("ok"), out


def test_split_norm_kernels_compile_to_sm90_ptx():
    """The producer's epilogue (split-K: a gpu-scope acq_rel count, the others' partials read past
    L1, the count reset; unsplit: none of that) and the consumer's row scale compile for the H200
    without a GPU; the PDL wait precedes every store."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    P = "*bf16"
    sig = {"x_ptr": P, "w_ptr": P, "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_ys": "i32", "stride_ym": "i32", "pf_ptr": P, "pf_units": "i32",
           "pf_regions": "i32", "pf_region_stride": "i64", "d_ptr": P, "stride_ds": "i32", "stride_dm": "i32",
           "nw_ptr": P, "res_ptr": P, "stride_rm": "i32", "eps": "fp32", "xr_ptr": P, "stride_xrm": "i32",
           "h_ptr": P, "ss_ptr": "*fp32", "cnt_ptr": "*i32"}
    names = ("M_BUCKET", "BLOCK_N", "BLOCK_K", "SWIGLU", "SPLIT_K", "USE_PDL", "PF_KIND", "PF_UNIT", "NORM",
             "DELTA_SPLITS", "RES_NORM", "SS_GROUPS", "SS_POW2")
    sig.update({name: "constexpr" for name in names})
    base = {"M_BUCKET": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SWIGLU": False, "SPLIT_K": 2, "USE_PDL": True,
            "PF_KIND": 0, "PF_UNIT": 64, "NORM": False, "DELTA_SPLITS": 0, "RES_NORM": True, "SS_GROUPS": 0,
            "SS_POW2": 1}

    def ptx(y_ptr, **consts):
        source = ASTSource(fn=skinny_gemm._skinny_gemm_kernel.fn, signature=dict(sig, y_ptr=y_ptr),
                           constexprs=dict(base, **consts))
        text = skinny_gemm.triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert text.index("griddepcontrol.wait") < text.index("st.global")
        return text

    split = ptx("*fp32")
    assert "atom.global.gpu.acq_rel.add" in split and "ld.global.cg" in split and "atom.global.gpu.acq_rel.exch" in split
    unsplit = ptx(P, SPLIT_K=1)
    assert "atom." not in unsplit and "ld.global.cg" not in unsplit
    for swiglu, block_n in ((False, 64), (True, 64)):
        consumer = ptx(P, SPLIT_K=1, RES_NORM=False, SS_GROUPS=256, SS_POW2=256, SWIGLU=swiglu, BLOCK_N=block_n)
        assert "atom." not in consumer
