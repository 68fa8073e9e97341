"""Sampling stays lossless when each step's k follows the request's own acceptance so far.

As tests/engine/test_sampling_lossless.py, over the first three tokens: the third is decided in a
step whose k the policy chose from the verdicts of the step before (a miss there: no drafts, a
hit: drafts), so k and the tokens are correlated; their joint must still be the target's."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from specd.engine.builder import build_engine
from specd.engine.draft_policy import DraftLengthPolicy
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling import SamplingTensors, processed_probs
from specd.sampling_params import SamplingParams
from tests.engine.draft_costs import FixedCost
from tests.engine.test_sampling_lossless import (  # noqa: F401 (a fixture)
    NUM_DRAWS, PROMPT, VOCAB, chi_square_pvalue, tiny_vocab_models)

K = 2
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True)


class PerTokenCost(FixedCost):
    """Every query token costs as much as a batch of NUM_DRAWS' base: a draft is worth verifying
    where its chance of being kept is above about half (the rate of k = 0), so a request whose first
    draft just missed drafts nothing next step and one whose drafts were kept drafts again."""

    def step_seconds(self, num_tokens, depth):
        return NUM_DRAWS + np.asarray(num_tokens, dtype=np.float64)


def exact_joint3(target_path) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT) under the target, [V, V, V]."""
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    st = SamplingTensors.from_params([PARAMS], torch.device("cpu"))

    def probs(rows: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(rows)).logits[:, -1]
        return processed_probs(logits, st.repeat_interleave(torch.full((1,), len(rows))))

    p1 = probs([PROMPT])[0]
    p2 = probs([PROMPT + [a] for a in range(VOCAB)])
    p3 = probs([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, VOCAB)
    return (p1[:, None, None] * p2[:, :, None] * p3).double().numpy()


def test_k_chosen_from_past_acceptance_keeps_the_target_distribution(tiny_vocab_models):
    target, draft = tiny_vocab_models
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=K, model=str(draft))
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=4096, block_size=16), spec)
    engine.draft_policy = DraftLengthPolicy(K, method="draft_model", cost=PerTokenCost(K), probe_every=0)
    draws = [SamplingParams(**{**PARAMS.__dict__, "seed": 5000 + i}) for i in range(NUM_DRAWS)]
    seqs = engine.generate([PROMPT] * NUM_DRAWS, draws)
    counts = np.zeros((VOCAB, VOCAB, VOCAB))
    for s in seqs:
        counts[tuple(s.output_token_ids[:3])] += 1
    lengths = engine.stats.draft_length_counts
    print(f"chosen k counts {lengths}")
    assert lengths[0] > 0.05 * sum(lengths) and sum(lengths[1:]) > 0.05 * sum(lengths)  # k varies
    pvalue = chi_square_pvalue(counts, exact_joint3(target))
    print(f"chi-square p-value over the first three tokens: {pvalue:.4f}")
    assert pvalue > 1e-3
