"""RMSNorm folded into the skinny GEMM after it: RMSNorm(x + delta) * w @ W^T in one kernel.

Why: at batch 1 each of a layer's two norms was a kernel of its own over a few KB, 3.2 us each of
a ~4.4 ms 8B step, 203 us in all (BENCHMARKS.md, run 20): mostly the wait for the GEMM before it
and the start of the GEMM after it, not work. The skinny GEMM walks all of x's K anyway (each
program owns some output columns and reads every K for them), so each program forms the residual
x + delta tile by tile (the delta being the o_proj / down_proj split-K partials), adds up its
squares, multiplies it by the norm's weight and feeds that to the tensor cores; 1 / rms is a
scale of the row, applied to the accumulator once the K loop is done. After the loop program p
also stores K tile p of the residual (the next norm's x, and the aux features the EAGLE drafter
takes). The price: every program re-reads x and the delta from L2, beside the weight stream.

Rounding: the residual is norm_act.rms_norm's bit for bit; the GEMM's operand is round(r * w)
scaled by 1 / rms in fp32 after the product, where the unfused path rounds r / rms, then times w:
the same value rounded at another point (the PyTorch twin agrees within bf16 rounding; the tests
say how closely). Deterministic, and a row's result still does not depend on the batch: its sum
of squares is its own, in a fixed order.

Opt-in, `SPECD_NORM_PROLOGUE=1` (read when the forward runs, so at capture for a CUDA graph), because
on the H200 it is slower, not faster: with Triton 3.6 the 8B step took 10.2-10.9 ms against
4.4-4.6 with the separate norm (BENCHMARKS.md, runs 29-33): qkv ~80 us against 15.6, gate/up
~180 against 56, about 2.2 us more per K step, as if the loop's loads no longer overlapped. Not
the cause, each tried: the squares summed across the tile in every K step, the residual store in
the loop, the norm weight's [BLOCK_K] load (a synchronous load in Triton 3.6's loop; now a tile
the pipeliner streams). Half the extra goes with the fp32 partials (run 34: a bf16 delta, 7.4 ms);
run 32's TTGIR does the elementwise work in the tensor cores' operand layout, where each warp
holds the whole x tile: a fix would do it in a layout of its own and convert once.
"""

from __future__ import annotations

import os

import torch

from specd.models import skinny_gemm
from specd.models.linear import takes_skinny_kernel

NORM_PROLOGUE_ENV = "SPECD_NORM_PROLOGUE"


def applies(x: torch.Tensor, proj) -> bool:
    """Whether the norm before proj (an nn.Linear-like) folds into proj's GEMM: the skinny kernel
    takes the product (few rows, "auto" backend), proj has no bias, and SPECD_NORM_PROLOGUE=1."""
    return (os.environ.get(NORM_PROLOGUE_ENV, "0") == "1" and proj.bias is None
            and takes_skinny_kernel(x, proj.weight))


def normed_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, swiglu: bool, *prefetch) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K]; delta None, [M, K] or fp32 split-K partials [S, M, K]; weight [N, K] ([2 I, K],
    gate rows then up rows, with swiglu). Returns (residual, y): residual = x + delta (x itself
    without a delta), y = RMSNorm(residual) * norm_weight @ weight^T [M, N] (swiglu: silu(gate) *
    up [M, I]). prefetch: the skinny ops' trailing L2 prefetch arguments."""
    if delta is None:
        return x, skinny_gemm_rmsnorm(x, norm_weight, eps, weight, swiglu, *prefetch)
    return skinny_gemm_add_rmsnorm(x, delta, norm_weight, eps, weight, swiglu, *prefetch)


def _columns(weight: torch.Tensor, swiglu: bool) -> int:
    return weight.shape[0] // 2 if swiglu else weight.shape[0]


@torch.library.custom_op("specd::skinny_gemm_rmsnorm", mutates_args=())
def skinny_gemm_rmsnorm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                        swiglu: bool, prefetch: torch.Tensor | None = None, prefetch_units: int = 0,
                        prefetch_regions: int = 1, prefetch_kind: int = 0) -> torch.Tensor:
    """RMSNorm(x) * norm_weight @ weight^T (swiglu: silu * up of it), without a residual add."""
    return skinny_gemm._launch(x, weight, _columns(weight, swiglu), swiglu, 1, prefetch, prefetch_units,
                               prefetch_regions, prefetch_kind, skinny_gemm.NormPrologue(norm_weight, eps))


@skinny_gemm_rmsnorm.register_fake
def _(x, norm_weight, eps, weight, swiglu, prefetch=None, prefetch_units=0, prefetch_regions=1,
      prefetch_kind=0) -> torch.Tensor:
    return x.new_empty((x.shape[0], _columns(weight, swiglu)))


@torch.library.custom_op("specd::skinny_gemm_add_rmsnorm", mutates_args=())
def skinny_gemm_add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, swiglu: bool, prefetch: torch.Tensor | None = None,
                            prefetch_units: int = 0, prefetch_regions: int = 1, prefetch_kind: int = 0
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * norm_weight @ weight^T): normed_linear with a delta."""
    residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    norm = skinny_gemm.NormPrologue(norm_weight, eps, delta, residual)
    y = skinny_gemm._launch(x, weight, _columns(weight, swiglu), swiglu, 1, prefetch, prefetch_units,
                            prefetch_regions, prefetch_kind, norm)
    return residual, y


@skinny_gemm_add_rmsnorm.register_fake
def _(x, delta, norm_weight, eps, weight, swiglu, prefetch=None, prefetch_units=0, prefetch_regions=1,
      prefetch_kind=0) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty((x.shape[0], _columns(weight, swiglu)))
