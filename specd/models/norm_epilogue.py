"""RMSNorm split across two skinny GEMMs: the residual add in the producer's epilogue, 1 / rms in
the consumer's (experimental: `SPECD_NORM_EPILOGUE=1`).

Why: each decoder layer runs two norms between GEMMs (after o_proj, before gate/up; after
down_proj, before the next qkv), 3.2 us each at batch 1 on an H200 (BENCHMARKS.md, issue 5), and
almost all of it is waiting: for the GEMM before to finish, then for the norm's few KB, before the
GEMM after may start. Folding the whole norm into the consumer's K loop (normed_gemm.py) made that
loop's elementwise work slow the weight stream twice over. This keeps both K loops as they are and
splits the norm at its seams instead:

- producer (o_proj / down_proj, usually split-K): the last program of each column tile to finish
  (an atomic count per tile) sums the tile's fp32 partials in split order, adds the residual, and
  writes the new residual r, h = r * norm_weight (rounded to the model dtype) and r's squares
  summed every SS_COLS columns, ss [N / SS_COLS, M];
- consumer (gate/up, the next layer's qkv): multiplies h as its x, and scales each row of the fp32
  product by 1 / sqrt(sum(ss) / K + eps) before rounding (a row scale commutes with the product).

RMSNorm(r) * w @ W^T = (r * w) @ W^T / rms(r): the same product, rounded at another point (h is
rounded before the 1 / rms instead of after), so it is within bf16 rounding of the norm kernel's,
not bit-equal to it. Deterministic: fixed summation orders everywhere, whichever program counts
last; a row's result depends on its own values only. The counters are per producer weight, zeroed
once, outside any CUDA-graph capture, and every launch leaves them at zero again (the last program
resets its tile's count), so the ops mutate nothing visible and replays need no memset.
"""

from __future__ import annotations

import os

import torch

from specd.models import skinny_gemm
from specd.models.linear import takes_skinny_kernel

NORM_EPILOGUE_ENV = "SPECD_NORM_EPILOGUE"

_COUNTERS_ATTR = "_specd_tile_counters"  # held by the weight itself: they live and die together


def applies(x: torch.Tensor, residual: torch.Tensor, producer, consumer) -> bool:
    """Whether the norm between producer (x [M, K] @ its weight^T is residual's [M, H] delta) and
    consumer (which takes the norm's output) splits across their GEMMs: SPECD_NORM_EPILOGUE=1 (read
    when the forward runs, i.e. at capture), both take the skinny kernel at M rows, neither has a
    bias, and H is a multiple of SS_COLS."""
    return (os.environ.get(NORM_EPILOGUE_ENV, "0") == "1" and producer.bias is None and consumer.bias is None
            and residual.shape[1] % skinny_gemm.SS_COLS == 0 and residual.stride(1) == 1
            and takes_skinny_kernel(x, producer.weight) and takes_skinny_kernel(residual, consumer.weight))


def counters_for(weight: torch.Tensor) -> torch.Tensor:
    """The producer weight's tile counters (int32 [N / SS_COLS], zero), made on first use: the
    static path's warm-up, never inside a capture (a capture-time zeros would be a memset node
    replayed every step, and memory of the graph's pool)."""
    counters = getattr(weight, _COUNTERS_ATTR, None)
    if counters is None:
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("norm_epilogue: tile counters must exist before a CUDA-graph capture "
                               "(run the forward once outside it)")
        counters = torch.zeros(weight.shape[0] // skinny_gemm.SS_COLS, dtype=torch.int32, device=weight.device)
        setattr(weight, _COUNTERS_ATTR, counters)
    return counters


def residual_norm_product(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                          norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The producer: x [M, K] @ weight[N, K]^T is the delta of residual [M, N]. Returns (r, h, ss):
    r = residual + delta, h = r * norm_weight [M, N] in x's dtype, ss [N / SS_COLS, M] fp32."""
    splits = skinny_gemm.split_k_for(*weight.shape)
    return skinny_gemm_residual_norm(x, weight, splits, residual, norm_weight, counters_for(weight))


def row_scaled_product(h: torch.Tensor, ss: torch.Tensor, eps: float, weight: torch.Tensor,
                       swiglu: bool = False) -> torch.Tensor:
    """The consumer: RMSNorm(r) * w @ weight^T [M, N] from the producer's h and ss (swiglu: weight
    is [2 I, K], gate rows then up rows, and the result silu(gate) * up [M, I])."""
    return skinny_gemm_row_scaled(h, weight, ss, eps, swiglu)


@torch.library.custom_op("specd::skinny_gemm_residual_norm", mutates_args=())
def skinny_gemm_residual_norm(x: torch.Tensor, weight: torch.Tensor, splits: int, residual: torch.Tensor,
                              norm_weight: torch.Tensor, counters: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """residual_norm_product's kernel (counters: counted up and back to zero within the launch,
    hence not declared mutated)."""
    m, n = x.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    h = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ss = torch.empty((n // skinny_gemm.SS_COLS, m), dtype=torch.float32, device=x.device)
    epilogue = skinny_gemm.ResidualNorm(residual, norm_weight, counters, out, h, ss)
    skinny_gemm._launch(x, weight, n, False, splits, res_norm=epilogue)
    return out, h, ss


@skinny_gemm_residual_norm.register_fake
def _(x, weight, splits, residual, norm_weight, counters):
    m, n = x.shape[0], weight.shape[0]
    return (x.new_empty((m, n)), x.new_empty((m, n)),
            x.new_empty((n // skinny_gemm.SS_COLS, m), dtype=torch.float32))


@torch.library.custom_op("specd::skinny_gemm_row_scaled", mutates_args=())
def skinny_gemm_row_scaled(h: torch.Tensor, weight: torch.Tensor, ss: torch.Tensor, eps: float,
                           swiglu: bool) -> torch.Tensor:
    """row_scaled_product's kernel."""
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return skinny_gemm._launch(h, weight, n, swiglu, 1, row_scale=skinny_gemm.RowScale(ss, eps))


@skinny_gemm_row_scaled.register_fake
def _(h, weight, ss, eps, swiglu):
    return h.new_empty((h.shape[0], weight.shape[0] // 2 if swiglu else weight.shape[0]))
