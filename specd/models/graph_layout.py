"""The static layout's buckets (batch sizes, block-table widths): pure functions of the batch,
so the layouts cuda_graphs.py captures are chosen the same on CPU."""

from __future__ import annotations

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


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
