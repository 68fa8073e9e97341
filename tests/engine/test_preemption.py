"""Preemption under a short KV cache, for every proposer on the paged runner: a preempted sequence
is freed, re-prefilled later with its tokens kept, and its drafter state rebuilt (EAGLE-3 from the
re-prefill's hidden rows, the draft model from its history, n-gram from the tokens). Its output
must be what it would have been with room to spare: greedy output, target-only seeded sampling
(the noise is drawn by (seed, position), so a re-prefill changes nothing), and constrained output
(the grammar matcher is rebuilt by replaying the output)."""

from __future__ import annotations

import pytest

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams
from tests.engine.test_greedy_lossless import make_requests
from tests.engine.test_structured_lossless import constrained_engine, grammars

DRAFTS = {"ngram": None, "eagle3": "draft-eagle3", "draft_model": "draft-llama-small"}
SHORT = 12  # blocks of 8 tokens: the 8 requests of make_requests preempt (tests/engine/test_cache_pressure.py)


def config(num_blocks: int = 0) -> PytorchEngineConfig:
    return PytorchEngineConfig(max_batch_size=8, block_size=8, session_len=256, num_gpu_blocks=num_blocks)


def spec(tiny_models, method: str) -> SpeculativeConfig:
    draft = DRAFTS[method]
    return SpeculativeConfig(method=method, num_speculative_tokens=3, model=str(tiny_models[draft]) if draft else "")


def sampled(params: list[SamplingParams]) -> list[SamplingParams]:
    return [SamplingParams(**{**p.__dict__, "temperature": 0.9, "top_k": 20, "seed": 7 + i})
            for i, p in enumerate(params)]


@pytest.mark.parametrize("method", list(DRAFTS))
def test_preempted_output_is_the_roomy_output(tiny_models, method):
    target = tiny_models["target-llama"]
    prompts, params = make_requests(512, seed=1)
    roomy = build_engine(target, config(), spec(tiny_models, method))
    want = [s.output_token_ids for s in roomy.generate(prompts, params)]
    assert roomy.stats.num_preemptions == 0
    short = build_engine(target, config(SHORT), spec(tiny_models, method))
    got = short.generate(prompts, params)
    assert [s.output_token_ids for s in got] == want
    assert short.stats.num_preemptions > 0
    assert sum(s.stats.num_draft_tokens for s in got) > 0  # drafting went on around the re-prefills


def test_preempted_sampled_output_is_the_roomy_output(tiny_models):
    """Target-only: each token's noise is drawn by (seed, position), so a re-prefill changes
    nothing. (With drafts, which token a sampled step emits depends on the drafts, and a short
    cache plans fewer of them: there the distribution is what holds, test_sampling_lossless.)"""
    target = tiny_models["target-llama"]
    prompts, params = make_requests(512, seed=1)
    params = sampled(params)
    want = [s.output_token_ids for s in build_engine(target, config()).generate(prompts, params)]
    short = build_engine(target, config(SHORT))
    assert [s.output_token_ids for s in short.generate(prompts, params)] == want
    assert short.stats.num_preemptions > 0


def test_preempted_constrained_output_is_the_roomy_output(tiny_models):
    target = tiny_models["target-llama"]
    some = grammars()
    specs = [some[2], some[0]] * 4  # the EBNF list grows to ~36 tokens: enough to preempt
    prompts = [[5 + i, 9, 13 + 2 * i] * (3 + i % 3) for i in range(len(specs))]
    params = [SamplingParams(max_new_tokens=40) for _ in specs]
    want = constrained_engine(target, spec(tiny_models, "eagle3")).generate(prompts, params, specs)
    short = constrained_engine(target, spec(tiny_models, "eagle3"), num_gpu_blocks=8)  # blocks of 16
    got = short.generate(prompts, params, specs)
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in want]
    assert short.stats.num_preemptions > 0
