"""The static layout's buckets (batch sizes, block-table widths) and the graph split setting:
pure functions of the batch, so the layouts cuda_graphs.py captures are chosen the same on CPU."""

from __future__ import annotations

import os

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Layers in the head graph (cuda_graphs.py's module doc; 0: one graph). Read at capture.
GRAPH_HEAD_LAYERS_ENV = "SPECD_GRAPH_HEAD_LAYERS"
DEFAULT_GRAPH_HEAD_LAYERS = 0


def graph_head_layers() -> int:
    """SPECD_GRAPH_HEAD_LAYERS as an int >= 0 (default DEFAULT_GRAPH_HEAD_LAYERS)."""
    raw = os.environ.get(GRAPH_HEAD_LAYERS_ENV, "")
    try:
        value = int(raw) if raw else DEFAULT_GRAPH_HEAD_LAYERS
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{GRAPH_HEAD_LAYERS_ENV}: expected a whole number of layers >= 0, got {raw!r}")
    return value


def batch_buckets(max_batch_size: int, buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS) -> tuple[int, ...]:
    """The buckets up to max_batch_size, with max_batch_size itself as the last."""
    out = [b for b in buckets if b < max_batch_size]
    return tuple(out + [max_batch_size])


def width_bucket(num_blocks: int) -> int:
    """Round a block-table width up to 4 steps per power of two (1..4, 5, 6, 7, 8, 10, 12, ...).

    Contexts grow by a few tokens per step; coarse buckets keep the number of graphs small, while
    4 steps per octave keep the gathered (and masked-out) keys within 25% of the needed ones.
    """
    if num_blocks <= 4:
        return max(1, num_blocks)
    step = 1 << (num_blocks.bit_length() - 3)
    return -(-num_blocks // step) * step
