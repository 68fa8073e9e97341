"""Triton pieces of the norm folded into its neighbour GEMMs (norm_fold.py says why and how).

finalize_residual: the split-K GEMM's last program of a column block (arrival_counters.py) sums
the block's fp32 partials in split order, rounds the sum to the model dtype (the unsplit product's
rounding), adds it to the residual (rounded: norm_act.rms_norm's residual, bit for bit), stores the
new residual, the residual times the next norm's weight (the next GEMM's operand), and the sums of
the residual's squares per 16 columns, [N / 16, M] fp32.

row_rstd: the next GEMM's 1 / rms per row from those sums, [M_BUCKET]: a row scale of its product.
"""

from __future__ import annotations

import triton
import triton.language as tl

SQUARES_GROUP = 16  # columns per stored sum of squares (the smallest BLOCK_N of the skinny GEMM)


@triton.jit
def finalize_residual(y_ptr, stride_ys, stride_ym, x, w, r_ptr, h_ptr, stride_rm, ss_ptr, counter_ptr,
                      pid, rows, cols, M, N, SPLIT_K: tl.constexpr, M_BUCKET: tl.constexpr, BLOCK_N: tl.constexpr):
    """After program (pid, split) stored its partial y[split, rows, cols]: the block's last program
    writes r = x + sum(y) [M, BLOCK_N] to r_ptr, h = r * w to h_ptr (both stride_rm) and the
    squares' sums of r per 16 columns to ss_ptr [N / 16, M]. x: the residual's tile [M_BUCKET,
    BLOCK_N] and w: the norm weight's [BLOCK_N] fp32, loaded by the caller before its stores (their
    latency hides under the arrival's)."""
    tl.debug_barrier()  # every thread's partial stored before the arrival (released by it)
    arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
    if arrived == SPLIT_K - 1:  # the column block's last program: every split's partial is visible
        ok = (rows[:, None] < M) & (cols[None, :] < N)
        p = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        d = tl.load(p, mask=ok, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):  # split order, whichever program arrived last
            d += tl.load(p + s * stride_ys, mask=ok, other=0.0, cache_modifier=".cg")
        d = d.to(r_ptr.dtype.element_ty)  # the product's rounding
        r = (x.to(tl.float32) + d.to(tl.float32)).to(r_ptr.dtype.element_ty)  # the residual add's
        out = rows[:, None] * stride_rm + cols[None, :]
        tl.store(r_ptr + out, r, mask=ok)
        rf = r.to(tl.float32)
        tl.store(h_ptr + out, (rf * w[None, :]).to(h_ptr.dtype.element_ty), mask=ok)
        squares = tl.sum(tl.reshape(rf * rf, (M_BUCKET, BLOCK_N // 16, 16)), axis=2)  # [M_BUCKET, BLOCK_N / 16]
        groups = pid * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
        tl.store(ss_ptr + groups[None, :] * M + rows[:, None], squares,
                 mask=(rows[:, None] < M) & (groups[None, :] < N // 16))
        tl.store(counter_ptr + pid, 0)  # zero again for the next product, the next replay


@triton.jit
def row_rstd(ss_ptr, rows, M, K, eps, GROUPS: tl.constexpr):
    """1 / rms of each row [M_BUCKET] from its squares' sums ss [K / 16, M] (GROUPS: K / 16 rounded
    up to a power of two); padding rows get 1 / sqrt(eps), harmless (never stored)."""
    g = tl.arange(0, GROUPS)
    ss = tl.load(ss_ptr + g[:, None] * M + rows[None, :], mask=(g[:, None] < K // 16) & (rows[None, :] < M),
                 other=0.0)
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
