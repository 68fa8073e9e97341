"""A KV cache too small for the batch: admissions, preemptions and draft budgets plan the batch's
appends together (specd/models/append_plan.py).

Before, each sequence was checked alone: eight prompts that each fit the free blocks were
admitted together and their prefill failed with CacheFullError, as did a verify step whose
sequences each had room for their k + 1 tokens but not all of them at once; the engine raised,
which fails every request of the verifier. Now every step fits, preempted sequences come back,
and the output is still the target's own greedy output, token for token. Two neighbours of the
same failure: a prompt within k tokens of the context length, and a cache smaller than one
context (the engine then serves the cache's length).
"""

from __future__ import annotations

import pytest

from specd.engine.builder import build_engine
from specd.messages import ConfigError, PytorchEngineConfig, SpeculativeConfig
from specd.models.append_plan import AppendPlan
from specd.sampling_params import SamplingParams
from tests.engine.test_greedy_lossless import make_requests

BLOCK = 8


def config(num_blocks: int = 0) -> PytorchEngineConfig:
    return PytorchEngineConfig(max_batch_size=8, block_size=BLOCK, session_len=256, num_gpu_blocks=num_blocks)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("num_blocks", [10, 12])
def test_small_cache_keeps_the_targets_output(tiny_models, seed, num_blocks):
    target = tiny_models["target-llama"]
    prompts, params = make_requests(512, seed=seed)
    want = [s.output_token_ids for s in build_engine(target, config()).generate(prompts, params)]
    for spec in (None, SpeculativeConfig(method="ngram", num_speculative_tokens=3)):
        engine = build_engine(target, config(num_blocks), spec)
        done = engine.generate(prompts, params)
        assert [s.output_token_ids for s in done] == want
        assert engine.stats.num_preemptions > 0  # the cache was short: sequences had to wait
        kv = engine.runner.kv_cache
        assert kv.allocator.num_free_blocks == kv.num_blocks


def plan_over(cached: dict[int, int], free_blocks: int, session_len: int | None = None) -> AppendPlan:
    """A plan over sequences holding `cached` tokens each, blocks of BLOCK tokens, none spare."""
    def new_blocks(seq_id: int, n: int) -> int:
        have = -(-cached[seq_id] // BLOCK)
        return max(0, -(-(cached[seq_id] + n) // BLOCK) - have)
    return AppendPlan(free_blocks, cached.__getitem__, new_blocks, session_len)


def test_two_sequences_that_fit_alone_do_not_fit_together():
    plan = plan_over({0: 8, 1: 16}, free_blocks=1)  # both at a block's end: any token needs a block
    assert plan.take(0, 1)
    assert not plan.take(1, 1) and plan.free_blocks == 0
    assert plan_over({0: 8, 1: 16}, free_blocks=1).take(1, 1)  # alone it fits


def test_claims_are_per_sequence_totals():
    plan = plan_over({0: 6}, free_blocks=2)
    assert plan.take(0, 1) and plan.free_blocks == 2  # within its last block
    assert plan.take(0, 4) and plan.free_blocks == 1  # 6 + 4 = 10 tokens: one new block
    assert plan.take(0, 3) and plan.free_blocks == 1  # less than claimed: nothing more
    assert plan.take(0, 18) and plan.free_blocks == 0  # 24 tokens: the second block
    assert not plan.take(0, 19) and plan.free_blocks == 0  # a third: none left, nothing claimed


def test_session_length_bounds_a_claim():
    plan = plan_over({0: 250}, free_blocks=10, session_len=256)
    assert plan.take(0, 6) and not plan.take(0, 7)


@pytest.mark.parametrize("prompt_len", [250, 254, 255])
def test_a_prompt_near_the_context_length_finishes(tiny_models, prompt_len):
    """Admission claimed the prompt and k drafts past it: past the context length for a prompt
    within k of it, so the engine found no room even in an empty cache and raised (in the
    verifier: every request failed). A sequence never caches more than the context less one."""
    engine = build_engine(tiny_models["target-llama"], config(),
                          SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    (seq,) = engine.generate([[5 + i % 50 for i in range(prompt_len)]], [SamplingParams(max_new_tokens=20)])
    assert seq.finish_reason == "length" and len(seq.output_token_ids) == 256 - prompt_len


def test_a_cache_shorter_than_the_context_serves_its_own_length(tiny_models):
    """48 tokens of cache under a 256-token context: the engine serves a 48-token context, so a
    request past it is refused with a clear error and one within it stops at it ("length"),
    where before a request that outgrew the cache stopped the engine."""
    engine = build_engine(tiny_models["target-llama"], config(6),  # 6 blocks of 8 tokens
                          SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    assert engine.max_model_len == 48
    with pytest.raises(ConfigError, match="context length 48"):
        engine.add_request(list(range(5, 65)), SamplingParams(max_new_tokens=4))
    prompts, params = make_requests(512, seed=0)
    short = [(p[:20], SamplingParams(**{**sp.__dict__, "max_new_tokens": 100})) for p, sp in zip(prompts, params)]
    done = engine.generate([p for p, _ in short], [sp for _, sp in short])
    assert all(len(s.prompt_token_ids) + len(s.output_token_ids) <= 48 for s in done)
    assert any(s.finish_reason == "length" and len(s.prompt_token_ids) + len(s.output_token_ids) == 48 for s in done)


@pytest.mark.parametrize("seed", range(40))
def test_the_planned_draft_lengths_are_the_same_with_the_roomy_cache_shortcut(seed):
    """plan_draft_lengths skips the claims when every sequence's k + 1 tokens fit at once
    (AppendPlan.fits_everyone); its ks must equal the claims' ks, in roomy and tight caches, near
    max_new_tokens and near the context length."""
    import random

    from specd.engine.drafting import plan_draft_lengths
    from specd.engine.sequence import Sequence

    rng = random.Random(seed)
    k, max_model_len = rng.choice([1, 3, 7, 12]), rng.choice([40, 64, 256])
    batch, cached = [], {}
    for i in range(rng.randint(1, 9)):
        prompt = [3] * rng.randint(1, max_model_len - 2)
        params = SamplingParams(max_new_tokens=rng.randint(1, 60), ignore_eos=True)
        seq = Sequence(i, prompt, params, output_token_ids=[4] * rng.randint(0, min(params.max_new_tokens,
                                                                                    max_model_len - len(prompt)) - 1))
        batch.append(seq)
        cached[i] = seq.num_tokens - 1  # the cache holds all but the last token
    needed = sum(-(-(k + 1) // BLOCK) for _ in batch)
    free_blocks = rng.choice([0, 1, needed - 1, needed, needed + 5])
    session_len = rng.choice([None, max_model_len, max_model_len + 3])

    def plan(block_size):
        p = plan_over(cached, max(free_blocks, 0), session_len)
        p.block_size = block_size
        return p

    shortcut = plan(BLOCK)
    assert shortcut.fits_everyone(len(batch), k + 1) == (max(free_blocks, 0) >= needed)
    assert plan_draft_lengths(batch, shortcut, k, max_model_len) == plan_draft_lengths(batch, plan(None), k,
                                                                                        max_model_len)
