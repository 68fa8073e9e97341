"""How the step bench times and reads one verify step of a runner (bench/step.py).

A step is a forward of `batch` sequences holding `context` cached tokens, q new tokens each, rolled
back after, so the same step repeats; its time is the median over iterations, synchronised.
"""

from __future__ import annotations

import contextlib
import time

import torch

from specd.models.base import SequenceChunk
from specd.models.llama_runner import LlamaRunner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# On CUDA, warm-up runs at least this long: an idle H200's SM clock sits at ~345 MHz and climbs
# to ~1980 under load (KINDS.md), and three 4 ms steps did not get it there. In run 8 the column
# timed first (the default graphs, after the setup's host-only work) came out 4.5% slower than the
# very same graphs captured again and timed later in the run.
MIN_CUDA_WARMUP_S = 0.5


def _median_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    t_end = time.perf_counter() + (MIN_CUDA_WARMUP_S if device.type == "cuda" else 0.0)
    done = 0
    while done < warmup or time.perf_counter() < t_end:
        fn()
        done += 1
        if done % 16 == 0:
            _sync(device)  # keep the host from queueing seconds of work ahead of the clock
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


@contextlib.contextmanager
def repeatable_step(runner: LlamaRunner, batch: int, q: int, context: int):
    """Yields step(): a forward of `batch` sequences holding `context` cached tokens, q new tokens
    each, rolled back after, so the same step repeats. The sequences are freed on exit."""
    ids = list(range(batch))
    for s in ids:
        runner.add_sequence(s)
        runner.kv_cache.append_slots(s, context)  # cached context: slots reserved, values irrelevant
    vocab = runner.config.vocab_size
    chunks = [SequenceChunk(s, [(7 * s + j) % vocab for j in range(q)]) for s in ids]

    def step():
        runner.forward(chunks)
        for s in ids:
            runner.truncate(s, context)

    try:
        yield step
    finally:
        for s in ids:
            runner.free(s)


def time_specd(runner: LlamaRunner, batch: int, q: int, context: int, warmup: int, iters: int) -> float:
    """Forward of `batch` sequences holding `context` tokens, q new tokens each (rolled back after)."""
    with repeatable_step(runner, batch, q, context) as step:
        return _median_ms(step, runner.device, warmup, iters)


def step_logits(runner: LlamaRunner, batch: int, q: int, context: int) -> torch.Tensor:
    """The logits [batch * q, V] of one step as time_specd runs it (rolled back after). The cached
    keys and values are N(0, 1) draws seeded by the sequence, written through its block table:
    what a sequence attends to must not depend on which physical blocks the allocator hands out
    (a free list returns them in another order on the next call)."""
    ids = list(range(batch))
    for s in ids:
        runner.add_sequence(s)
        runner.kv_cache.append_slots(s, context)
        _fill_sequence_cache(runner, s)
    vocab = runner.config.vocab_size
    try:
        return runner.forward([SequenceChunk(s, [(7 * s + j) % vocab for j in range(q)]) for s in ids]).logits
    finally:
        for s in ids:
            runner.free(s)


def _fill_sequence_cache(runner: LlamaRunner, seq_id: int) -> None:
    """Every cache block of seq_id, in every layer, gets N(0, 1) draws seeded by (seq_id, layer)."""
    blocks = torch.tensor(runner.kv_cache.block_table(seq_id), device=runner.device)
    for layer, (k, v) in enumerate(zip(runner.kv_cache.k_caches, runner.kv_cache.v_caches)):
        gen = torch.Generator(device=runner.device).manual_seed(1000 * seq_id + layer)
        for cache in (k, v):
            shape = (len(blocks),) + tuple(cache.shape[1:])
            cache[blocks] = torch.randn(shape, generator=gen, device=runner.device, dtype=cache.dtype)
