"""The accept path is exercised: a perfect drafter is always accepted; n-gram copies are accepted."""

from __future__ import annotations

import pytest

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_as_its_own_draft_model_is_always_accepted(tiny_models, k, temperature):
    target = tiny_models["target-llama"]
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=str(target))
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=4), spec)
    prompts = [[5, 6, 7], [9] * 11, [40, 41, 42, 43, 44, 45, 46], [100]]
    params = [SamplingParams(temperature=temperature, max_new_tokens=1 + 4 * (k + 1), ignore_eos=True,
                             seed=i) for i in range(4)]
    seqs = engine.generate(prompts, params)
    for s in seqs:
        assert s.num_output_tokens == 1 + 4 * (k + 1)
        # p == q, so every draft passes the accept test: acceptance length k + 1 at every step.
        assert s.stats.num_drafts == 4
        assert s.stats.num_accepted_tokens == s.stats.num_draft_tokens == 4 * k
        assert s.stats.mean_acceptance_length == k + 1
        assert s.stats.accepted_per_position == [4] * k


def test_ngram_accepts_when_the_target_copies(tiny_models):
    """A random tiny target falls into a cycle under greedy decoding; n-gram lookup then hits."""
    target = tiny_models["target-llama"]
    plain = build_engine(target, PytorchEngineConfig(max_batch_size=1))
    seed_prompt = [17, 18, 19, 20]
    greedy = plain.generate([seed_prompt], [SamplingParams(max_new_tokens=96, ignore_eos=True)])[0]
    # The prompt is the target's own continuation: whatever it repeats, it repeats from here on.
    prompt = seed_prompt + greedy.output_token_ids[:64]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    want = build_engine(target, PytorchEngineConfig(max_batch_size=1)).generate([prompt], [params])[0]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    got = build_engine(target, PytorchEngineConfig(max_batch_size=1), spec).generate([prompt], [params])[0]
    assert got.output_token_ids == want.output_token_ids
    print(f"ngram on a copying continuation: {got.stats.to_dict()}")
    assert got.stats.num_accepted_tokens > 0
    assert got.stats.mean_acceptance_length > 1.5
