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
# to ~1980 under load (KINDS.md), and three 4 ms steps did not get it there: the column timed
# first (after the setup's host-only work) came out 4.5% slower than the very same graphs
# captured again and timed later.
MIN_CUDA_WARMUP_S = 0.5


def _median_ms(fn, device: torch.device, warmup: int, iters: int, before=None, after=None) -> float:
    """fn's median time over iters calls, synchronised. before() and after() run around each
    call, untimed (before's device work finished before the clock starts)."""
    t_end = time.perf_counter() + (MIN_CUDA_WARMUP_S if device.type == "cuda" else 0.0)
    done = 0
    while done < warmup or time.perf_counter() < t_end:
        if before is not None:
            before()
        fn()
        if after is not None:
            after()
        done += 1
        if done % 16 == 0:
            _sync(device)  # keep the host from queueing seconds of work ahead of the clock
    _sync(device)
    times = []
    for _ in range(iters):
        if before is not None:
            before()
            _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if after is not None:
            after()
    times.sort()
    return times[len(times) // 2]


def _step_chunks(runner: LlamaRunner, batch: int, q: int) -> list[SequenceChunk]:
    vocab = runner.config.vocab_size
    return [SequenceChunk(s, [(7 * s + j) % vocab for j in range(q)]) for s in range(batch)]


@contextlib.contextmanager
def _cached_sequences(runner: LlamaRunner, batch: int, context: int):
    """Sequences 0..batch-1, each holding `context` cached tokens (slots reserved, values
    irrelevant); freed on exit."""
    ids = list(range(batch))
    for s in ids:
        runner.add_sequence(s)
        runner.kv_cache.append_slots(s, context)
    try:
        yield ids
    finally:
        for s in ids:
            runner.free(s)


@contextlib.contextmanager
def repeatable_step(runner: LlamaRunner, batch: int, q: int, context: int):
    """Yields step(): a forward of `batch` sequences holding `context` cached tokens, q new tokens
    each, rolled back after, so the same step repeats. The sequences are freed on exit."""
    chunks = _step_chunks(runner, batch, q)
    with _cached_sequences(runner, batch, context) as ids:
        def step():
            runner.forward(chunks)
            for s in ids:
                runner.truncate(s, context)

        yield step


def time_specd(runner: LlamaRunner, batch: int, q: int, context: int, warmup: int, iters: int) -> float:
    """Forward of `batch` sequences holding `context` tokens, q new tokens each (rolled back after)."""
    with repeatable_step(runner, batch, q, context) as step:
        return _median_ms(step, runner.device, warmup, iters)


def time_specd_staged(runner: LlamaRunner, batch: int, q: int, context: int, warmup: int, iters: int) -> float:
    """The same step as the engine launches it once its drafts are back: the batch staged before
    the clock starts (LlamaRunner.stage: slots, buffers, placeholder ids; the engine does this
    while the drafters work, specd/engine/staging.py), the timed part the token ids written,
    the replay and the wait for it. Raises where the batch does not stage (no static path)."""
    chunks = _step_chunks(runner, batch, q)
    placeholders = [SequenceChunk(c.seq_id, [0] * len(c.token_ids)) for c in chunks]
    with _cached_sequences(runner, batch, context) as ids:
        def stage():
            if not runner.stage(placeholders):
                raise RuntimeError(f"batch {batch} q {q} does not stage on this runner")

        def rollback():
            for s in ids:
                runner.truncate(s, context)

        staged_before = runner.num_staged_forwards
        ms = _median_ms(lambda: runner.forward(chunks), runner.device, warmup, iters, before=stage, after=rollback)
        assert runner.num_staged_forwards - staged_before >= iters  # every timed forward took its stage
        return ms


@contextlib.contextmanager
def engine_like_step(runner: LlamaRunner, batch: int, q: int, context: int, *, staged: bool, gap_ms: float):
    """Yields step(): the verify step as the engine runs it between two of its syncs: the batch
    staged (staged) or not, then gap_ms of host idle (the drafter round trip; the device idle too),
    then the forward, taking the stage or doing its host work there; rolled back after (the
    caller syncs). Why: the engine's staged forward at batch 1 has taken 0.3 ms longer on the
    device than its unstaged one, the same graph, while a staged column timed as stage, then at
    once the forward, was the faster; this puts the gap between them."""
    chunks = _step_chunks(runner, batch, q)
    placeholders = [SequenceChunk(c.seq_id, [0] * len(c.token_ids)) for c in chunks]
    with _cached_sequences(runner, batch, context) as ids:
        def step():
            if staged and not runner.stage(placeholders):
                raise RuntimeError(f"batch {batch} q {q} does not stage on this runner")
            time.sleep(gap_ms / 1e3)
            runner.forward(chunks)
            for s in ids:
                runner.truncate(s, context)

        yield step


def step_logits(runner: LlamaRunner, batch: int, q: int, context: int, staged: bool = False) -> torch.Tensor:
    """The logits [batch * q, V] of one step as time_specd (staged: time_specd_staged) runs it.
    The cached keys and values are N(0, 1) draws seeded by the sequence, written through its block
    table: what a sequence attends to must not depend on which physical blocks the allocator hands
    out (a free list returns them in another order on the next call)."""
    chunks = _step_chunks(runner, batch, q)
    with _cached_sequences(runner, batch, context) as ids:
        for s in ids:
            _fill_sequence_cache(runner, s)
        if staged and not runner.stage([SequenceChunk(c.seq_id, [0] * len(c.token_ids)) for c in chunks]):
            raise RuntimeError(f"batch {batch} q {q} does not stage on this runner")
        return runner.forward(chunks).logits


def _fill_sequence_cache(runner: LlamaRunner, seq_id: int) -> None:
    """Every cache block of seq_id, in every layer, gets N(0, 1) draws seeded by (seq_id, layer)."""
    blocks = torch.tensor(runner.kv_cache.block_table(seq_id), device=runner.device)
    for layer, (k, v) in enumerate(zip(runner.kv_cache.k_caches, runner.kv_cache.v_caches)):
        gen = torch.Generator(device=runner.device).manual_seed(1000 * seq_id + layer)
        for cache in (k, v):
            shape = (len(blocks),) + tuple(cache.shape[1:])
            cache[blocks] = torch.randn(shape, generator=gen, device=runner.device, dtype=cache.dtype)
