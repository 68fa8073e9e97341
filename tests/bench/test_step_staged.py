"""The step bench's staged column: the verify step timed as the engine launches it (the batch
staged before its drafts exist, bench/step_timing.py), on the CPU static path."""

from __future__ import annotations

import time

import pytest
import torch

from bench.step import arch_config, random_model
from bench.step_timing import step_logits, time_specd, time_specd_staged
from specd.messages import PytorchEngineConfig
from specd.models.llama_runner import LlamaRunner


def _runner(static: bool) -> LlamaRunner:
    config = arch_config("small")
    model = random_model(config, torch.float32, torch.device("cpu"))
    engine = PytorchEngineConfig(block_size=8, max_batch_size=4, num_gpu_blocks=64, session_len=80,
                                 device_type="cpu")
    return LlamaRunner(".", engine, model=model, config=config, use_static_path=static)


def test_staged_step_computes_the_unstaged_logits_and_every_timed_forward_takes_its_stage():
    runner = _runner(static=True)
    for batch, q in ((1, 4), (4, 4), (3, 1)):
        plain = step_logits(runner, batch, q, context=40)
        staged_before = runner.num_staged_forwards
        staged = step_logits(runner, batch, q, context=40, staged=True)
        assert runner.num_staged_forwards == staged_before + 1
        assert torch.equal(staged, plain)  # the placeholders were overwritten by the real ids
        assert staged.shape == (batch * q, runner.config.vocab_size)

    free_before = runner.kv_cache.allocator.num_free_blocks
    before = runner.num_staged_forwards
    ms = time_specd_staged(runner, batch=2, q=4, context=40, warmup=2, iters=5)
    assert ms > 0 and runner.num_staged_forwards - before == 2 + 5  # warm-up and timed, each staged
    assert runner.kv_cache.allocator.num_free_blocks == free_before and not runner.staged  # all rolled back, freed
    assert time_specd(runner, batch=2, q=4, context=40, warmup=1, iters=3) > 0  # the cache is usable after


def test_a_runner_without_the_static_path_says_its_step_does_not_stage():
    runner = _runner(static=False)
    free_before = runner.kv_cache.allocator.num_free_blocks
    with pytest.raises(RuntimeError, match="does not stage"):
        time_specd_staged(runner, batch=1, q=4, context=16, warmup=1, iters=1)
    assert runner.kv_cache.allocator.num_free_blocks == free_before  # its sequences freed all the same


def test_runners_sharing_one_cache_compute_what_each_computes_alone():
    """The step bench's three paths over one KV cache (three 8B caches and transformers' did not
    fit an 80 GB card): each timing adds and frees its sequences, so a path's logits on
    the shared cache are its logits on a cache of its own; a cache of another shape is refused."""
    static = _runner(static=True)
    config = static.config
    engine = PytorchEngineConfig(block_size=8, max_batch_size=4, num_gpu_blocks=64, session_len=80,
                                 device_type="cpu")
    sharing = LlamaRunner(".", engine, model=static.model, config=config, use_static_path=False,
                          kv_cache=static.kv_cache)
    alone = LlamaRunner(".", engine, model=static.model, config=config, use_static_path=False)
    assert sharing.kv_cache is static.kv_cache
    for batch, q in ((1, 4), (3, 1)):
        first = step_logits(static, batch, q, context=40)
        assert torch.equal(step_logits(sharing, batch, q, context=40), step_logits(alone, batch, q, context=40))
        assert torch.equal(step_logits(static, batch, q, context=40), first)  # the static path unharmed
    assert static.kv_cache.allocator.num_free_blocks == 64
    other = PytorchEngineConfig(block_size=16, max_batch_size=4, num_gpu_blocks=64, session_len=80,
                                device_type="cpu")
    with pytest.raises(ValueError, match="shared cache"):
        LlamaRunner(".", other, model=static.model, config=config, use_static_path=False,
                    kv_cache=static.kv_cache)


def test_the_engine_like_step_computes_the_plain_steps_logits_staged_or_not():
    """bench/step_timing.py engine_like_step (the timeline's staged / unstaged cases after an
    idle gap): each forward takes its stage when staged, none when not; the cache is rolled back
    after each step and freed after."""
    from bench.step_timing import engine_like_step

    runner = _runner(static=True)
    free_before = runner.kv_cache.allocator.num_free_blocks
    for staged in (False, True):
        before = runner.num_staged_forwards
        with engine_like_step(runner, 2, 4, 40, staged=staged, gap_ms=1.0) as step:
            t0 = time.perf_counter()
            for _ in range(3):
                step()
                assert runner.kv_cache.num_tokens(0) == 40 and not runner.staged  # rolled back
            assert time.perf_counter() - t0 >= 3e-3  # the gaps were slept
        assert runner.num_staged_forwards - before == (3 if staged else 0)
        assert runner.kv_cache.allocator.num_free_blocks == free_before
