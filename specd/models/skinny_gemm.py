"""A Triton GEMM for few rows: y = x @ W^T with x [M, K], M <= 32, W [N, K] (nn.Linear layout).

Why: a small-batch verify step multiplies a handful of rows by every weight matrix once; the work
is reading W (16 GB at 8B, 3.35 ms at 4.8 TB/s). So the kernel is a weight stream: each program
owns BLOCK_N output columns, walks K in BLOCK_K tiles with several in flight (num_stages) and
multiplies them with the few x rows on the tensor cores (x padded to 16 rows by masking). Each
output element is one program's sequential sum, so the result depends neither on the launch shape
nor on the batch's other rows.

Split-K (`skinny_gemm_partials`): at N = 4096 (o_proj, down_proj) N / BLOCK_N programs leave SMs
idle, so K is split into S ranges, each program storing an fp32 partial [S, M, N] (H200, M = 4,
S = 2: o 10.65 us against 12.7, down 30.87 against 34.1). The consumer sums them in fixed order
(kernels/norm_act.rms_norm) and rounds as an unsplit product would; S is a fixed rule of the shape
(`split_k_for`), not of M, so the result stays deterministic.

`skinny_linear` dispatches: CUDA, bf16/fp16, M <= MAX_ROWS, Triton, K a multiple of the smallest
BLOCK_K -> the kernel (a torch custom op, one opaque call to graph capture and torch.compile); else
F.linear. Block shapes are autotuned per (M bucket, N, K, S) in the static path's warm-up, except
the 8B shapes at few rows on Hopper (TUNED_SM90). Tests run the kernel through Triton's
interpreter on CPU against float64.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specd.models.kernels.pdl import launch_options, use_pdl

MAX_ROWS = 32
MIN_BLOCK_K = 64
# Bytes of each weight row a program pulls into L2 before its PDL wait, past the first tile it
# loads anyway, while the kernel before it (a norm, the attention merge) leaves HBM idle: on the
# H200's 8B step 512 gained 1-2.7%, 2048 and more lost; sized per product it was slower
# (BENCHMARKS.md, "Tried and removed").
PREWAIT_BYTES = 512

try:
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install: the F.linear path serves
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Block shapes measured inside the 8B verify graph on an H200 (batch 1, q 4: M bucket 16; each
# product's added time per layer; BENCHMARKS.md, "Tried and removed", has pinned ones): the
# autotuner times a product alone from a cold L2, which ranks these shapes differently from the
# graph and, timing noise deciding, picked o_proj shapes 1-4 us a layer slower in some processes.
# Keyed by (M bucket, N, K, SwiGLU, splits); used on compute capability 9.0; other shapes and
# devices autotune.
TUNED_SM90 = {
    (16, 6144, 4096, False, 1): (64, 128, 4, 4),  # qkv: 15.4 us against the autotuner's 16.4
    (16, 4096, 4096, False, 2): (32, 128, 4, 6),  # o_proj
    (16, 14336, 4096, True, 1): (64, 128, 4, 4),  # gate_up + SwiGLU
    (16, 4096, 14336, False, 2): (32, 128, 4, 6),  # down_proj
    (16, 128256, 4096, False, 1): (64, 128, 4, 4),  # lm_head
}


def tuned_config(x: torch.Tensor, n: int, k: int, swiglu: bool, splits: int) -> dict | None:
    """TUNED_SM90's launch options for this product on this device, or None (autotune)."""
    shape = TUNED_SM90.get((_row_bucket(x.shape[0]), n, k, swiglu, splits))
    if shape is None or not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0):
        return None
    block_n, block_k, warps, stages = shape
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}


def prewait_lines(x: torch.Tensor) -> int:
    """128-byte lines of each weight row prefetched before the PDL wait (PREWAIT_BYTES as a power
    of two of lines); none without PDL (nothing to overlap), before sm_90, on CPU and in the
    interpreter. A hint: it cannot change a result."""
    if (os.environ.get("TRITON_INTERPRET") == "1" or not use_pdl(x)
            or torch.cuda.get_device_capability(x.device)[0] < 9):
        return 0
    return 1 << (PREWAIT_BYTES // 128 - 1).bit_length()  # the next power of two (tl.arange's length)


def _configs():
    if _INTERPRET:  # the interpreter runs every config on CPU: keep it to one, small
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64}, num_warps=4, num_stages=1)]
    out = []
    for block_n, block_k, warps, stages in [
            (16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 6), (32, 512, 8, 3),
            (64, 128, 4, 4), (64, 256, 8, 3), (16, 1024, 8, 2), (128, 64, 4, 5), (64, 64, 4, 8)]:  # the last (BLOCK_K 64) fits any (K / S) % 64 == 0
        out.append(triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps,
                                 num_stages=stages))
    return out


if triton is not None:
    from specd.models.kernels.pdl import gdc_release, gdc_wait

    @triton.jit
    def _prefetch_l2(ptrs):
        """One L2 prefetch per address in ptrs (a hint: nothing comes back, nothing waits)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    def _divides_k(configs, named_args, **kwargs):
        """Only block shapes whose BLOCK_K divides a split's K range, K / SPLIT_K (the loop has no
        K mask)."""
        k_len = named_args["K"] // {**named_args, **kwargs}["SPLIT_K"]  # a keyword from _launch
        return [c for c in configs if k_len % c.kwargs["BLOCK_K"] == 0] or configs[-1:]

    @triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "SWIGLU", "SPLIT_K"],
                     prune_configs_by={"early_config_prune": _divides_k})
    @triton.jit
    def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ys, stride_ym,
                            M_BUCKET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            SWIGLU: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
                            PREWAIT_LINES: tl.constexpr = 0):
        """Grid (cdiv(N, BLOCK_N), SPLIT_K). SPLIT_K 1: y [M, N] in x's dtype. SPLIT_K > 1: program
        (n, s) sums K range s (K / SPLIT_K long) into y[s] of fp32 partials y [SPLIT_K, M, N].
        PREWAIT_LINES > 0: that many 128-byte lines of each weight row past the first tile are
        prefetched into L2 before the PDL wait (prewait_lines)."""
        # silu(gate) * up is not linear: it needs the whole sum, so no split with the epilogue
        tl.static_assert(SPLIT_K == 1 or not SWIGLU)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        k_len = K // SPLIT_K  # a multiple of BLOCK_K (_divides_k, split_k_for)
        rows = tl.arange(0, M_BUCKET)  # [M_BUCKET] x rows (>= 16 for tl.dot; masked past M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = rows of W
        ks = split * k_len + tl.arange(0, BLOCK_K)  # [BLOCK_K] this split's first K tile
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [M_BUCKET, BLOCK_K]
        w_ptrs = w_ptr + cols[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
        u_ptrs = w_ptrs + N * stride_wn  # SWIGLU: the up rows, N below the gate rows
        row_ok = rows[:, None] < M
        col_ok = cols[:, None] < N
        # The first weight tile is read before waiting for the previous kernel (PDL, pdl.py):
        # no kernel writes weights, and the read overlaps the previous kernel's tail.
        w = tl.load(w_ptrs, mask=col_ok, other=0.0)
        u = w
        if SWIGLU:
            u = tl.load(u_ptrs, mask=col_ok, other=0.0)
        if PREWAIT_LINES > 0:  # the next lines of each weight row into L2 while the predecessor runs
            lines = BLOCK_K + tl.arange(0, PREWAIT_LINES) * 64  # 128-byte lines of 2-byte elements
            pre = w_ptr + cols[:, None] * stride_wn + split * k_len + tl.minimum(lines, k_len - 64)[None, :]
            _prefetch_l2(pre)
            if SWIGLU:
                _prefetch_l2(pre + N * stride_wn)
        gdc_wait(USE_PDL)
        x = tl.load(x_ptrs, mask=row_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w))  # [M_BUCKET, BLOCK_N] float32
        acc_up = tl.zeros((M_BUCKET, BLOCK_N), dtype=tl.float32)
        if SWIGLU:
            acc_up = tl.dot(x, tl.trans(u))
        for _ in range(BLOCK_K, k_len, BLOCK_K):
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            w = tl.load(w_ptrs, mask=col_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w))
            if SWIGLU:
                u_ptrs += BLOCK_K
                u = tl.load(u_ptrs, mask=col_ok, other=0.0)
                acc_up += tl.dot(x, tl.trans(u))
        # The successor may launch once every program is past its loads: not earlier, or its
        # waiting programs would hold SM room that this grid's later waves need (pdl.py).
        gdc_release(USE_PDL)
        out = acc.to(y_ptr.dtype.element_ty)  # partials: fp32 already, nothing rounded
        if SWIGLU:  # silu(gate) * up, rounded as the unfused path rounds (norm_act.silu_mul)
            gate = out.to(tl.float32)
            up = acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
            out = (act * up).to(y_ptr.dtype.element_ty)
        y_ptrs = y_ptr + split * stride_ys + rows[:, None] * stride_ym + cols[None, :]
        tl.store(y_ptrs, out, mask=row_ok & (cols[None, :] < N))


def _row_bucket(m: int) -> int:
    return 16 if m <= 16 else 32


def split_k_for(n: int, k: int) -> int:
    """The number of K splits for a product with weight [N, K]: 2 when N <= 8192 and each half of K
    is a whole number of the smallest BLOCK_K tiles, else 1.

    Why: at N = 4096 (o_proj, down_proj) the N / BLOCK_N column programs are too few to keep the
    H200's 132 SMs streaming weights; split-K 2 took 16% (o) and 9% (down) off their time at M = 4
    (bench/gemm_sweep.py). 8192 is a round bound above those; the wider products (gate/up 28672,
    lm_head 128256 columns) have programs enough. The consumers decide whether to take partials
    (fused_forward: o_proj and down_proj, whose outputs go to an rms_norm).
    Why fixed and not autotuned: the split changes the fp32 summation order, so it must be a rule
    of the shape alone (never of M, nor of a timing), like today's one-program-per-column sum."""
    return 2 if n <= 8192 and k % (2 * MIN_BLOCK_K) == 0 else 1


def _launch(x: torch.Tensor, weight: torch.Tensor, n: int, swiglu: bool, splits: int = 1) -> torch.Tensor:
    """y [M, N] in x's dtype (splits 1), or fp32 partials [splits, M, N] (splits > 1)."""
    m, k = x.shape
    assert k % (splits * MIN_BLOCK_K) == 0, (k, splits)
    shape, dtype = ((splits, m, n), torch.float32) if splits > 1 else ((m, n), x.dtype)
    y = torch.empty(shape, dtype=dtype, device=x.device)
    if m == 0:
        return y
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), splits)  # noqa: E731 - Triton's grid idiom
    options = {}
    prewait = prewait_lines(x)
    if prewait:
        options["PREWAIT_LINES"] = prewait
    tuned = tuned_config(x, n, k, swiglu, splits)
    kernel = _skinny_gemm_kernel.fn if tuned else _skinny_gemm_kernel  # the JIT function: no autotuning
    kernel[grid](x, weight, y, m, n, k, x.stride(0), weight.stride(0), m * n, n, M_BUCKET=_row_bucket(m), SWIGLU=swiglu, SPLIT_K=splits,
                 **options, **(tuned or {}), **launch_options(use_pdl(x)))
    return y


@torch.library.custom_op("specd::skinny_gemm", mutates_args=())
def skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype (float32 accumulation)."""
    return _launch(x, weight, weight.shape[0], False, 1)


@skinny_gemm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("specd::skinny_gemm_partials", mutates_args=())
def skinny_gemm_partials(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """Split-K: x [M, K], weight [N, K] -> fp32 partials [splits, M, N] whose sum over dim 0 is
    x @ weight^T (K % (splits * MIN_BLOCK_K) == 0; split_k_for picks splits). The consumer sums
    them (norm_act.rms_norm's delta)."""
    return _launch(x, weight, weight.shape[0], False, splits)


@skinny_gemm_partials.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    return x.new_empty((splits, x.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("specd::skinny_gemm_swiglu", mutates_args=())
def skinny_gemm_swiglu(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product and activation in one kernel: gate_up [2 I, K] (gate rows, then up rows);
    returns silu(x @ gate^T) * (x @ up^T) [M, I], each product rounded to x's dtype first, as
    norm_act.silu_mul over the unfused product rounds (one launch and no [M, 2 I] round trip)."""
    return _launch(x, gate_up, gate_up.shape[0] // 2, True, 1)


@skinny_gemm_swiglu.register_fake
def _(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], gate_up.shape[0] // 2))


def kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear takes the Triton kernel for these operands."""
    return (triton is not None and x.ndim == 2 and 0 < x.shape[0] <= MAX_ROWS
            and (x.is_cuda or _INTERPRET) and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.shape[1] % MIN_BLOCK_K == 0
            and x.stride(1) == 1 and weight.stride(1) == 1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], through the kernel when it applies (see module)."""
    flat = x.reshape(-1, x.shape[-1])
    if not kernel_applies(flat, weight):
        return F.linear(x, weight, bias)
    y = skinny_gemm(flat, weight)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])

