"""The replay drafter (bench only): known acceptance, lossless output, divergence handling."""

from __future__ import annotations

import random

import pytest

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.proposers.base import DraftRequest
from specd.proposers.replay import (ReplayProposer, corrupt_rate_for, expected_acceptance_length,
                                    load_references, write_references)
from specd.sampling_params import SamplingParams

K = 3


def test_acceptance_math():
    assert expected_acceptance_length(0.0, 3) == 4.0
    assert expected_acceptance_length(1.0, 3) == 1.0
    r = corrupt_rate_for(3.0, 3)
    assert 0.18 < r < 0.2
    assert abs(expected_acceptance_length(r, 3) - 3.0) < 1e-9
    with pytest.raises(ValueError, match="acceptance_length"):
        corrupt_rate_for(5.0, 3)


def test_proposes_the_reference_and_notices_divergence():
    prompt, output = [5, 6, 7], [10, 11, 12, 13, 14, 15]
    p = ReplayProposer({tuple(prompt): output}, vocab_size=100)
    p.open(0, SamplingParams())
    first = p.propose([DraftRequest(0, prompt + [10], None, 3)])[0]
    assert first.token_ids.tolist() == [11, 12, 13]
    assert p.propose([DraftRequest(0, [11, 12], None, 3)])[0].token_ids.tolist() == [13, 14, 15]
    p.propose([DraftRequest(0, [99], None, 3)])  # the target took another token
    assert p.num_diverged == 1
    p.open(1, SamplingParams())
    p.propose([DraftRequest(1, [1, 2], None, 2)])  # no reference for this prompt
    assert p.num_diverged == 2


def _references(tiny_models, prompts, max_new):
    engine = build_engine(tiny_models["target-llama"], PytorchEngineConfig(max_batch_size=8, block_size=8))
    seqs = engine.generate(prompts, [SamplingParams(max_new_tokens=max_new, ignore_eos=True) for _ in prompts])
    return [s.output_token_ids for s in seqs]


@pytest.mark.parametrize("rate", [0.0, 0.19])
def test_engine_acceptance_matches_the_set_rate(tiny_models, tmp_path, rate):
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(3, 20))] for _ in range(6)]
    max_new = 60
    want = _references(tiny_models, prompts, max_new)
    refs = tmp_path / "refs.jsonl"
    write_references(refs, list(zip(prompts, want)))
    assert load_references(refs)[tuple(prompts[0])] == want[0]
    spec = SpeculativeConfig(method="replay", num_speculative_tokens=K, replay_references=str(refs),
                             replay_corrupt_rate=rate)
    engine = build_engine(tiny_models["target-llama"], PytorchEngineConfig(max_batch_size=8, block_size=8), spec)
    seqs = engine.generate(prompts, [SamplingParams(max_new_tokens=max_new, ignore_eos=True) for _ in prompts])
    assert [s.output_token_ids for s in seqs] == want  # lossless, as every proposer
    assert engine.proposer.num_diverged == 0
    drafts = sum(s.stats.num_drafts for s in seqs)
    accepted = sum(s.stats.num_accepted_tokens for s in seqs)
    measured = 1 + accepted / drafts
    expected = expected_acceptance_length(rate, K)
    print(f"rate {rate}: acceptance length measured {measured:.3f}, expected {expected:.3f}")
    if rate == 0.0:
        # Every step but a sequence's last (k shrinks near max_new_tokens) accepts all k drafts.
        assert measured > 3.8
    else:
        assert abs(measured - expected) < 0.35
