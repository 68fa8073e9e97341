"""Sums in a fixed pairwise order, for results that must not depend on a kernel's launch shape.

`tl.sum` reduces in an order set by the tensor's layout (which elements a thread holds, then warp
shuffles), and the layout follows num_warps and the block shape: an autotuned config. The sums of
squares behind RMSNorm's scale (skinny_gemm's fused norm) are kept the same whatever config or
batch bucket ran them, so they are summed as a balanced tree over adjacent pairs:
((x0 + x1) + (x2 + x3)) + ..., the same bits on any layout (tests: bit-equal to the torch tree).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install
    triton = None


if triton is not None:
    @triton.jit
    def _pair_sum(x, R: tl.constexpr, C: tl.constexpr):
        # [R, C // 2]: columns (2j, 2j + 1) added. A sum over an axis of 2 is one addition, the
        # same whichever operand comes first, so the layout cannot change it.
        return tl.sum(tl.reshape(x, (R, C // 2, 2)), axis=2)

    @triton.jit
    def tree_sum_rows(x, R: tl.constexpr, C: tl.constexpr, LOG2_C: tl.constexpr):
        """x [R, C] float32, C = 2 ** LOG2_C -> [R]: each row summed as a pairwise tree."""
        for level in tl.static_range(LOG2_C):
            x = _pair_sum(x, R, C >> level)
        return tl.reshape(x, (R,))


def tree_sum_reference(x: torch.Tensor) -> torch.Tensor:
    """The same order in PyTorch: x [..., C] (C a power of two) -> [...]."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]
