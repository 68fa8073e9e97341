"""RMSNorm (optionally with the residual add before it) and SwiGLU's silu(gate) * up, in Triton.

The eager layer runs RMSNorm as a float cast, the norm, a cast back and the weight multiply, and
the residual add and SwiGLU as separate kernels; at small batch each is a launch over a few KB.
One program per token row does each of these in one pass. Rounding follows the PyTorch modules
step for step (llama.RMSNorm: norm in float32, cast to the model dtype, then times the weight in
the model dtype; the residual add and silu rounded to the model dtype before they are used), so
the kernels and the PyTorch twin agree to the last bit in most rows; tests compare them on CPU
through Triton's interpreter.

The residual add may take its delta as split-K partials (skinny_gemm.skinny_gemm_partials: fp32
[S, T, H]): the norm sums them in fixed order (((p0 + p1) + p2) ...) in fp32 and rounds the sum to
the model dtype, which is what the unsplit GEMM's output would be rounded to; so the reduction
costs no launch and no [T, H] round trip, and the add after it is today's.
"""

from __future__ import annotations

import os

import torch

from specd.models.kernels.pdl import launch_options, use_pdl

try:
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install
    triton = None


if triton is not None:
    from specd.models.kernels.pdl import gdc_wait_and_release

    @triton.jit
    def _rmsnorm_kernel(x_ptr, delta_ptr, w_ptr, res_out_ptr, out_ptr, stride_x, stride_ds, stride_d,
                        stride_r, stride_o, eps, H: tl.constexpr, BLOCK: tl.constexpr,
                        DELTA_SPLITS: tl.constexpr, USE_PDL: tl.constexpr):
        """One program per token row t. DELTA_SPLITS 0: no delta; S >= 1: delta is S addends
        (stride_ds apart) of row t's delta: [T, H] in any dtype (S = 1) or fp32 partials [S, T, H]."""
        t = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < H
        w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)  # a weight: read before the wait
        gdc_wait_and_release(USE_PDL)
        x = tl.load(x_ptr + t * stride_x + c, mask=ok, other=0.0)
        if DELTA_SPLITS > 0:
            d_ptrs = delta_ptr + t * stride_d + c
            d = tl.load(d_ptrs, mask=ok, other=0.0).to(tl.float32)
            for s in tl.static_range(1, DELTA_SPLITS):  # fixed order: deterministic
                d += tl.load(d_ptrs + s * stride_ds, mask=ok, other=0.0).to(tl.float32)
            d = d.to(x_ptr.dtype.element_ty)  # the product's rounding (exact for a bf16 delta)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the bf16 add
            tl.store(res_out_ptr + t * stride_r + c, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t * stride_o + c, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
        gdc_wait_and_release(USE_PDL)
        t = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < inter
        gate = tl.load(gu_ptr + t * stride_gu + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + t * stride_gu + inter + c, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t * stride_o + c, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def kernel_applies(x: torch.Tensor) -> bool:
    return (triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and x.dtype in (torch.float16, torch.bfloat16) and x.ndim == 2 and x.stride(-1) == 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H]; delta: None, [T, H] in x's dtype, or fp32 split-K partials [S, T, H] (their sum
    in order, rounded to x's dtype, is the delta). Returns (residual, normed): residual = x + delta
    (x itself without delta), normed = RMSNorm(residual) * weight."""
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    residual = torch.empty_like(x) if delta is not None else x
    splits, stride_ds = 0, 0
    if delta is not None:
        assert delta.shape[-2:] == x.shape and delta.stride(-1) == 1, (delta.shape, x.shape)
        splits, stride_ds = (1, 0) if delta.ndim == 2 else (delta.shape[0], delta.stride(0))
    d = delta if delta is not None else x
    if tokens:
        _rmsnorm_kernel[(tokens,)](
            x, d, weight, residual, out, x.stride(0), stride_ds, d.stride(-2), residual.stride(0),
            out.stride(0), eps, H=hidden, BLOCK=triton.next_power_of_2(hidden), DELTA_SPLITS=splits,
            num_warps=4 if hidden <= 4096 else 8, **launch_options(use_pdl(x)))
    return residual, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 I] (gate rows first) -> silu(gate) * up [T, I]."""
    tokens, two_inter = gate_up.shape
    inter = two_inter // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
            **launch_options(use_pdl(gate_up)))
    return out
