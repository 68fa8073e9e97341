"""warm_up_engine (specd/engine/warm_up.py): the verifier's load-time request leaves no trace.

After it the engine holds no sequence, every KV block is free again, its statistics are zero,
and served requests decode exactly what a fresh engine decodes. On the static path (CUDA graphs
on the GPU, the same buffers run eagerly here) it has made the prefill and verify layouts.
"""

from __future__ import annotations

import random

import pytest

from specd.engine.builder import build_engine
from specd.engine.engine import SpecEngine
from specd.engine.warm_up import warm_up_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.models.llama_runner import LlamaRunner
from specd.sampling_params import SamplingParams

K = 3
CONFIG = PytorchEngineConfig(max_batch_size=8, block_size=8)


def requests():
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
              for i in range(4)]
    return prompts, params


def outputs(engine):
    prompts, params = requests()
    return [s.output_token_ids for s in engine.generate(prompts, params)]


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_warmed_up_engine_serves_as_a_fresh_one(tiny_models, method):
    draft = {"draft_model": "draft-llama-small", "eagle3": "draft-eagle3"}[method]
    spec = SpeculativeConfig(method=method, num_speculative_tokens=K, model=str(tiny_models[draft]))
    warmed = build_engine(tiny_models["target-llama"], CONFIG, spec)
    free = warmed.runner.kv_cache.allocator.num_free_blocks
    assert warm_up_engine(warmed) > 0
    assert not warmed.has_unfinished() and not warmed.running
    assert warmed.runner.kv_cache.allocator.num_free_blocks == free
    assert warmed.stats.num_steps == 0 and warmed.stats.num_output_tokens == 0
    assert outputs(warmed) == outputs(build_engine(tiny_models["target-llama"], CONFIG, spec))


def test_warm_up_makes_the_static_layouts(tiny_models):
    plain = build_engine(tiny_models["target-llama"], CONFIG, SpeculativeConfig(
        method="draft_model", num_speculative_tokens=K, model=str(tiny_models["draft-llama-small"])))
    runner = LlamaRunner(str(tiny_models["target-llama"]), CONFIG, use_static_path=True)
    engine = SpecEngine(runner, plain.proposer, K, max_batch_size=CONFIG.max_batch_size,
                        max_model_len=plain.max_model_len)
    assert not runner.static._entries
    warm_up_engine(engine)
    layouts = {(batch, qlen) for (batch, qlen, _, _) in runner.static._entries}
    assert {(1, 16), (1, K + 1)} <= layouts  # the prompt's, and the verify step's (a draft model drafts k)
    assert engine.stats.num_steps == 0
