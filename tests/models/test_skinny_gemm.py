"""The skinny Triton GEMM (specd/models/skinny_gemm.py) on CPU, through Triton's interpreter.

The interpreter runs the kernel's own code with numpy (float16: numpy has no bfloat16, so the
interpreter cannot run bf16; the GPU bench checks bf16 against F.linear). Each check runs in a
subprocess because TRITON_INTERPRET must be set before triton.jit decorates the kernel.
"""

from __future__ import annotations

import pytest
import torch

from specd.models import skinny_gemm
from specd.models.linear import Linear, gemm_backend, linear, resolve_gemm_backend
from tests.models.interpreted import run_interpreted

pytestmark = pytest.mark.skipif(skinny_gemm.triton is None, reason="triton is a dependency (xgrammar pulls it)")


def test_kernel_matches_float64_for_few_rows_and_ragged_columns():
    out = run_interpreted("""
        import torch
        from specd.models.skinny_gemm import kernel_applies, skinny_gemm
        for seed, (m, n, k) in enumerate([(1, 48, 128), (4, 100, 192), (17, 64, 256), (32, 33, 64)]):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(m, k, generator=g).half()
            w = torch.randn(n, k, generator=g).half()
            assert kernel_applies(x, w)
            y = skinny_gemm(x, w)
            ref = x.double() @ w.double().T
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert y.shape == (m, n) and y.dtype == torch.float16 and torch.isfinite(y).all()
            print(m, n, k, err)
            assert err < 2e-3, (m, n, k, err)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_split_k_partials_sum_to_the_product_and_each_covers_its_k_range():
    """skinny_gemm_partials: fp32 [S, M, N]; partial s is x's and W's K range s (K / S long), so
    their sum is the product (near float64, closer than the bf16/fp16-rounded unsplit output)."""
    out = run_interpreted("""
        import torch
        from specd.models.skinny_gemm import skinny_gemm, skinny_gemm_partials
        for seed, (m, n, k, splits) in enumerate([(1, 48, 128, 2), (4, 100, 256, 2), (17, 64, 384, 3),
                                                  (32, 33, 512, 4)]):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(m, k, generator=g).half()
            w = torch.randn(n, k, generator=g).half()
            p = skinny_gemm_partials(x, w, splits)
            assert p.shape == (splits, m, n) and p.dtype == torch.float32, (p.shape, p.dtype)
            ref = x.double() @ w.double().T
            err = ((p.double().sum(0) - ref).norm() / ref.norm()).item()
            print(m, n, k, splits, err)
            assert err < 1e-5, (m, n, k, splits, err)  # fp32 sums: far below fp16's 5e-4 step
            kl = k // splits
            for s in range(splits):
                part = x[:, s * kl:(s + 1) * kl].double() @ w[:, s * kl:(s + 1) * kl].double().T
                assert ((p[s].double() - part).norm() / part.norm()).item() < 1e-5, (m, n, k, s)
            unsplit = skinny_gemm(x, w)
            assert torch.allclose(p.sum(0).half().float(), unsplit.float(), rtol=2e-3, atol=2e-2)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_split_count_is_a_rule_of_the_weight_shape():
    """2 for the 8B model's o_proj and down_proj (N = 4096), 1 for the wide products and where
    half of K is not a whole number of 64-wide tiles; launching with a bad split is refused."""
    assert skinny_gemm.split_k_for(4096, 4096) == 2 and skinny_gemm.split_k_for(4096, 14336) == 2
    assert skinny_gemm.split_k_for(8192, 4096) == 2
    assert skinny_gemm.split_k_for(28672, 4096) == 1 and skinny_gemm.split_k_for(128256, 4096) == 1
    assert skinny_gemm.split_k_for(4096, 4160) == 1 and skinny_gemm.split_k_for(64, 64) == 1
    with pytest.raises(AssertionError):
        skinny_gemm._launch(torch.zeros(2, 192).half(), torch.zeros(8, 192).half(), 8, False, splits=2)


def test_autotune_prune_keeps_block_k_that_divide_a_split():
    """The autotuner's own prune call, as a launch makes it (no GPU needed): every kept BLOCK_K
    divides K / SPLIT_K, and a split that only BLOCK_K 64 divides keeps that one."""
    tuner = skinny_gemm._skinny_gemm_kernel
    assert len(tuner.configs) > 1  # not the interpreter's single config: the prune runs on launch
    for k, splits, kept in [(14336, 1, {64, 128, 256, 512, 1024}), (14336, 2, {64, 128, 256, 512, 1024}),
                            (1536, 1, {64, 128, 256, 512}), (1536, 2, {64, 128, 256}), (4160, 1, {64}),
                            (384, 2, {64})]:
        tuner.nargs = dict(zip(tuner.arg_names, (None, None, None, 4, 4096, k)))
        configs = tuner.prune_configs({"M_BUCKET": 16, "SWIGLU": False, "SPLIT_K": splits, "USE_PDL": False})
        assert {c.kwargs["BLOCK_K"] for c in configs} == kept, (k, splits)
        assert all((k // splits) % c.kwargs["BLOCK_K"] == 0 for c in configs)
    tuner.nargs = None


def test_swiglu_epilogue_equals_the_product_then_the_activation_kernel():
    """skinny_gemm_swiglu rounds as the unfused path does: its output is silu_mul over the plain
    kernel's product exactly (same block shapes), and near float64's silu(x g^T) * (x u^T)."""
    out = run_interpreted("""
        import torch
        from specd.models.kernels.norm_act import silu_mul
        from specd.models.skinny_gemm import skinny_gemm, skinny_gemm_swiglu
        for seed, (m, inter, k) in enumerate([(1, 48, 128), (4, 100, 192), (19, 64, 256)]):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(m, k, generator=g).half()
            w = (torch.randn(2 * inter, k, generator=g) / k ** 0.5).half()
            fused = skinny_gemm_swiglu(x, w)
            unfused = silu_mul(skinny_gemm(x, w))
            assert fused.shape == (m, inter) and torch.isfinite(fused).all()
            assert torch.equal(fused, unfused), (m, inter, k, (fused - unfused).abs().max())
            gate, up = (x.double() @ w.double().T).split(inter, dim=1)
            ref = torch.nn.functional.silu(gate) * up
            err = ((fused.double() - ref).norm() / ref.norm()).item()
            assert err < 5e-3, (m, inter, k, err)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_static_path_logits_with_the_kernel_equal_cublas_within_rounding():
    """A whole runner forward (float16 on CPU, static path): "auto" GEMMs vs "torch" GEMMs."""
    out = run_interpreted("""
        import torch
        from bench.step import arch_config, random_model
        from specd.messages import PytorchEngineConfig
        from specd.models.base import SequenceChunk
        from specd.models import linear as linear_module, skinny_gemm
        from specd.models.llama_runner import LlamaRunner
        calls, swiglu_calls, partials_calls = [], [], []
        kernel, swiglu, partials = skinny_gemm.skinny_gemm, skinny_gemm.skinny_gemm_swiglu, skinny_gemm.skinny_gemm_partials
        def counting(x, w):
            calls.append(tuple(x.shape))
            return kernel(x, w)
        def counting_swiglu(x, w):
            swiglu_calls.append(tuple(x.shape))
            return swiglu(x, w)
        def counting_partials(x, w, splits):
            partials_calls.append((*x.shape, splits))
            return partials(x, w, splits)
        skinny_gemm.skinny_gemm, skinny_gemm.skinny_gemm_swiglu = counting, counting_swiglu
        skinny_gemm.skinny_gemm_partials = counting_partials
        cfg = arch_config("small")
        model = random_model(cfg, torch.float16, torch.device("cpu"))
        ec = PytorchEngineConfig(max_batch_size=2, block_size=16, num_gpu_blocks=32, session_len=128,
                                 device_type="cpu", dtype="float16")
        logits = {}
        for gemm in ("auto", "torch"):
            r = LlamaRunner(".", ec, model=model, config=cfg, use_static_path=True, gemm=gemm)
            for s in (0, 1):
                r.add_sequence(s)
                r.kv_cache.append_slots(s, 20)
            logits[gemm] = r.forward([SequenceChunk(0, [1, 2, 3, 4]), SequenceChunk(1, [5, 6, 7, 8])]).logits
        a, b = logits["auto"].double(), logits["torch"].double()
        err = ((a - b).norm() / b.norm()).item()
        print(err)
        assert a.shape == (8, cfg.vocab_size) and err < 5e-3, err
        # every layer's 4 GEMMs and the lm_head went through the kernel, in the "auto" runner only:
        # qkv, o (K = 64: too short to split) and the lm_head as plain products, gate/up with SwiGLU
        # in its epilogue, down (K = 128) split-K 2 into the next norm
        h = cfg.hidden_size
        assert len(calls) == 2 * cfg.num_hidden_layers + 1 and set(calls) == {(8, h),
            (8, cfg.num_attention_heads * cfg.head_dim)}, calls
        assert swiglu_calls == [(8, h)] * cfg.num_hidden_layers, swiglu_calls
        assert partials_calls == [(8, cfg.intermediate_size, 2)] * cfg.num_hidden_layers, partials_calls
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_dispatch_falls_back_to_f_linear_where_the_kernel_does_not_apply():
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    assert not skinny_gemm.kernel_applies(x, w)  # float32 on CPU, no interpreter
    assert not skinny_gemm.kernel_applies(torch.randn(33, 64).half(), w.half())  # too many rows
    assert not skinny_gemm.kernel_applies(torch.randn(4, 96).half(), torch.randn(8, 96).half())  # K % 64
    torch.testing.assert_close(skinny_gemm.skinny_linear(x, w), torch.nn.functional.linear(x, w))


def test_backend_is_scoped_and_validated(monkeypatch):
    layer = Linear(64, 8, bias=True)
    x = torch.randn(3, 64)
    with gemm_backend("auto"):
        assert skinny_gemm.kernel_applies(x, layer.weight) is False
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(linear(x, layer.weight), x @ layer.weight.T)
    monkeypatch.setenv("SPECD_GEMM", "torch")
    assert resolve_gemm_backend(None) == "torch"
    with pytest.raises(ValueError, match="gemm backend"):
        resolve_gemm_backend("cutlass")
