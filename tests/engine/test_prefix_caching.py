"""Prefix caching in the engine: prompts sharing a system prompt, and a conversation's next turns,
prefill only what the cache does not hold, and every method's greedy output is the same with
caching on and off, also with a cache small enough to evict (drafts rolled back over shared
blocks on the way; preemption with caching: test_cache_pressure.py, where it is on by default).
Drafters that need the target's hidden states get full prefills."""

from __future__ import annotations

import random

import pytest

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams
from tests.engine.test_greedy_lossless import METHODS

SYSTEM = [11 + (7 * i) % 300 for i in range(37)]  # shared by every request: 4 full blocks of 8


def config(caching: bool, num_blocks: int = 0) -> PytorchEngineConfig:
    return PytorchEngineConfig(max_batch_size=6, block_size=8, session_len=256, num_gpu_blocks=num_blocks,
                               enable_prefix_caching=caching)


def conversations(num: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [SYSTEM + [rng.randrange(4, 500) for _ in range(rng.randint(2, 12))] for _ in range(num)]


def chat(target, spec, caching: bool, num_blocks: int = 0, turns: int = 3):
    """Every conversation for `turns` turns: each turn's prompt is the last prompt, its reply and a
    new user message. Returns (outputs per turn, the engine)."""
    engine = build_engine(target, config(caching, num_blocks), spec)
    prompts, rng, outputs = conversations(), random.Random(1), []
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    for _ in range(turns):
        seqs = engine.generate(prompts, [params] * len(prompts))
        outputs.append([s.output_token_ids for s in seqs])
        prompts = [p + s.output_token_ids + [rng.randrange(4, 500) for _ in range(3)] for p, s in zip(prompts, seqs)]
    return outputs, engine


@pytest.mark.parametrize("method", [None, *METHODS])
def test_caching_keeps_every_methods_greedy_output(tiny_models, method):
    target_name, draft_name = METHODS[method] if method else ("target-llama", None)
    target, draft = tiny_models[target_name], tiny_models[draft_name] if draft_name else None
    spec = (SpeculativeConfig(method=method, num_speculative_tokens=3, model=str(draft) if draft else "")
            if method else None)
    want, _ = chat(target, spec, caching=False)
    got, engine = chat(target, spec, caching=True)
    assert got == want
    if engine._hidden_kind == "none":  # spec off, ngram, draft_model: the prompts came from the cache
        # every turn's requests share the system prompt; later turns find their whole history
        assert engine.stats.num_prefix_hit_tokens > 2 * 6 * 32
    else:  # EAGLE-3 and MTP heads need the target's hidden state of every prompt token
        assert engine.stats.num_prefix_hit_tokens == 0


@pytest.mark.parametrize("method", [None, "ngram"])
def test_caching_under_eviction(tiny_models, method):
    target = tiny_models["target-llama"]
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3) if method else None
    want, _ = chat(target, spec, caching=False)
    got, engine = chat(target, spec, caching=True, num_blocks=12)  # 6 requests of ~70 tokens: short
    assert got == want
    kv = engine.runner.kv_cache
    assert engine.stats.num_prefix_hit_tokens > 0 and kv.allocator.num_evictions > 0
    assert kv.allocator.num_free_blocks == kv.num_blocks  # every block back (free or cached)


def test_caching_on_the_static_path(tiny_models):
    """The CUDA graphs' CPU twin: a prefill after a cached prefix takes the static layouts with
    context (not only the fresh-prompt ones captured up front)."""
    from specd.engine.engine import SpecEngine
    from specd.models.llama_runner import LlamaRunner

    target = tiny_models["target-llama"]
    want, _ = chat(target, None, caching=False)
    runner = LlamaRunner(str(target), config(True), use_static_path=True)
    engine = SpecEngine(runner, None, 0, max_batch_size=6, max_model_len=256)
    prompts, rng = conversations(), random.Random(1)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    for turn in range(3):
        seqs = engine.generate(prompts, [params] * len(prompts))
        assert [s.output_token_ids for s in seqs] == want[turn]
        prompts = [p + s.output_token_ids + [rng.randrange(4, 500) for _ in range(3)] for p, s in zip(prompts, seqs)]
    assert engine.stats.num_prefix_hit_tokens > 0 and runner.static.num_static_forwards > 0


@pytest.mark.parametrize("method", [None, "ngram"])
def test_prompts_admitted_together_share_their_prefill(tiny_models, method):
    """Four requests of one prompt (n choices) arriving at once: one prefills it, the others wait a
    step and find it cached; sampled with their own seeds, each output is the uncached engine's."""
    target = tiny_models["target-llama"]
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3) if method else None
    prompt = SYSTEM[:33] + [9, 8, 7]  # 36 tokens: 4 full blocks before the last
    params = [SamplingParams(temperature=0.9, seed=50 + i, max_new_tokens=8, ignore_eos=True) for i in range(4)]
    want = [s.output_token_ids for s in build_engine(target, config(False), spec).generate([prompt] * 4, params)]
    engine = build_engine(target, config(True), spec)
    assert [s.output_token_ids for s in engine.generate([prompt] * 4, params)] == want
    assert engine.stats.num_prefix_hit_tokens == 3 * 32
    assert engine.stats.num_prefill_tokens == 36 + 3 * 4
