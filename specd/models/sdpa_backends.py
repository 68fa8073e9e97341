"""Which SDPA kernels the variable-shape attention calls may take: every one but cuDNN's.

Why: PyTorch prefers cuDNN's attention on Hopper, and cuDNN builds an execution plan for every new
shape: ~39 ms of host time a call on an H100 (torch 2.11; bench/drafter_head.py). The static
path's shapes repeat, so a plan would be built once; the eager paths' do not: a prefill's padded
lengths change with every admission, and an EAGLE-3 or MTP head's keys grow by one every draft
step, so their calls would pay for a plan whenever a shape came up first (an 8B EAGLE-3 head's
propose at batch 1: 111.7 ms with cuDNN against 5.0 without, H100, in-process). Flash,
memory-efficient and math kernels need no plan. On CPU the choice is PyTorch's (its flash kernel
or math).
"""

from __future__ import annotations

from torch.nn.attention import SDPBackend, sdpa_kernel

VARIABLE_SHAPE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def variable_shape_sdpa():
    """A context in which scaled_dot_product_attention picks among VARIABLE_SHAPE_BACKENDS."""
    return sdpa_kernel(VARIABLE_SHAPE_BACKENDS)
