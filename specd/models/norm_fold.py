"""RMSNorm folded into the GEMMs around it: the norm kernel between o_proj and gate/up, and between
down_proj and the next layer's qkv, disappears (SPECD_NORM_FOLD=1, an experiment until the GPU
says; read when the forward runs, i.e. at capture).

Why: at batch 1 each norm kernel adds ~3.4 us to a ~4.4 ms 8B step (63 of them: ~215 us;
BENCHMARKS.md, run 43's timeline), mostly the wait for the GEMM before it and the start of the GEMM
after it. Folding the norm into the next GEMM's K loop (normed_gemm.py, SPECD_NORM_PROLOGUE=1,
removed since) made every K step slower (runs 29-33). Here the K loops stay the plain GEMM's:
  - the split-K product before the norm (o_proj, down_proj) finishes the residual add in each
    column block's last program (kernels/residual_epilogue.finalize_residual, arrival counters):
    r = x + product (norm_act.rms_norm's residual, bit for bit), h = r * w (w: the norm's weight),
    and the sums of r's squares per 16 columns, [N / 16, M];
  - the product after it (qkv, gate/up) streams h as its x and scales each row of its accumulator
    by 1 / rms, summed from those squares (kernels/residual_epilogue.row_rstd) before its K loop.
Rounding: the operand is round(r * w) and 1 / rms scales the product in fp32, where the norm
kernel rounds r / rms and then times w (the PyTorch twin agrees within bf16 rounding, the tests
say how closely). The residual, the aux features (EAGLE) and the final
norm are unchanged. Deterministic: the partials are summed in split order, the squares per 16
columns and then over the groups in an order fixed by the kernel's shape.

`fused_forward` takes it per product pair where both products take the skinny kernel without a
bias (the first layer's input norm and the final norm stay kernels: no GEMM before them).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from specd.models import skinny_gemm
from specd.models.kernels.arrival_counters import arrival_counters
from specd.models.linear import takes_skinny_kernel

NORM_FOLD_ENV = "SPECD_NORM_FOLD"
SQUARES_GROUP = 16  # columns per sum of squares (kernels/residual_epilogue.py)


@dataclasses.dataclass(frozen=True)
class ResidualFinalize:
    """What a split-K product's last programs do after it: residual [M, N] + the product ->
    residual_out; residual_out * norm_weight [N] -> normed_out (both [M, N], rows contiguous); the
    squares' sums of residual_out per 16 columns -> squares [N / 16, M] fp32; counters: int32
    zeros, one per column block at least (kernels/arrival_counters.py)."""
    residual: torch.Tensor
    norm_weight: torch.Tensor
    residual_out: torch.Tensor
    normed_out: torch.Tensor
    squares: torch.Tensor
    counters: torch.Tensor


@dataclasses.dataclass(frozen=True)
class RowScale:
    """The product's rows scaled by 1 / sqrt(mean square + eps), the mean squares from a
    ResidualFinalize's squares [K / 16, M]."""
    squares: torch.Tensor
    eps: float


def enabled() -> bool:
    return os.environ.get(NORM_FOLD_ENV, "0") == "1"


def applies(x: torch.Tensor, before, after) -> bool:
    """Whether the norm between the products `before` (x its input) and `after` folds into them:
    SPECD_NORM_FOLD=1, both take the skinny kernel at x's rows (the same rows reach `after`),
    neither has a bias, and the norm's width is whole groups of 16 columns."""
    hidden = before.weight.shape[0]
    w = after.weight
    return (enabled() and before.bias is None and after.bias is None and hidden % SQUARES_GROUP == 0
            and takes_skinny_kernel(x, before.weight) and w.shape[1] == hidden and w.dtype == x.dtype
            and w.stride(1) == 1 and hidden % skinny_gemm.MIN_BLOCK_K == 0)


@torch.library.custom_op("specd::skinny_gemm_residual", mutates_args=("counters",))
def skinny_gemm_residual(x: torch.Tensor, weight: torch.Tensor, splits: int, residual: torch.Tensor,
                         norm_weight: torch.Tensor, counters: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] @ weight [N, K]^T added to residual [M, N]: returns (r = residual + product, r *
    norm_weight, the squares' sums of r per 16 columns [N / 16, M] fp32); the product split-K
    `splits` ways, its partials summed by each column block's last program. counters: int32
    zeros, N / 16 at least, zero again on return."""
    m, n = residual.shape
    residual_out, normed_out = torch.empty_like(residual), torch.empty_like(residual)
    squares = torch.empty((n // SQUARES_GROUP, m), dtype=torch.float32, device=x.device)
    skinny_gemm._launch(x, weight, n, False, splits, finalize=ResidualFinalize(
        residual, norm_weight, residual_out, normed_out, squares, counters))
    return residual_out, normed_out, squares


@skinny_gemm_residual.register_fake
def _(x, weight, splits, residual, norm_weight, counters):
    m, n = residual.shape
    return (torch.empty_like(residual), torch.empty_like(residual),
            residual.new_empty((n // SQUARES_GROUP, m), dtype=torch.float32))


@torch.library.custom_op("specd::skinny_gemm_row_scaled", mutates_args=())
def skinny_gemm_row_scaled(h: torch.Tensor, weight: torch.Tensor, squares: torch.Tensor, eps: float,
                           swiglu: bool) -> torch.Tensor:
    """(h @ weight^T) with row i times 1 / sqrt(sum(squares[:, i]) / K + eps), in h's dtype; with
    swiglu (weight: gate rows, then up rows) silu(gate) * up of the scaled products [M, I]."""
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return skinny_gemm._launch(h, weight, n, swiglu, 1, row_scale=RowScale(squares, eps))


@skinny_gemm_row_scaled.register_fake
def _(h, weight, squares, eps, swiglu):
    return h.new_empty((h.shape[0], weight.shape[0] // 2 if swiglu else weight.shape[0]))


@dataclasses.dataclass(frozen=True)
class FoldedNorm:
    """A norm folded away: the residual after it, its operand r * w, the squares' sums."""
    residual: torch.Tensor
    normed: torch.Tensor
    squares: torch.Tensor


def residual_product(proj, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     counter_owner: object | None) -> FoldedNorm:
    """residual + proj(x), folded toward the norm (weight norm_weight) after it (see the module)."""
    n, k = proj.weight.shape
    counters = arrival_counters(counter_owner, "residual product", x.device, n // SQUARES_GROUP)
    out = skinny_gemm_residual(x, proj.weight, skinny_gemm.split_k_for(n, k), residual, norm_weight, counters)
    return FoldedNorm(*out)


def scaled_product(proj, folded: FoldedNorm, eps: float, swiglu: bool = False) -> torch.Tensor:
    """proj(RMSNorm(folded.residual) * w) of the norm folded away (silu(gate) * up with swiglu)."""
    return skinny_gemm_row_scaled(folded.normed, proj.weight, folded.squares, eps, swiglu)
