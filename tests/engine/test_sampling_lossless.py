"""Sampling losslessness end to end: speculative sampling draws from the target's distribution.

20,000 requests with distinct seeds share a prompt on a tiny-vocabulary target; the empirical joint
of their first two tokens (the second comes out of a verify step: an accepted draft or a
recovered token) is compared with the exact joint computed from the target by a chi-square test.
A planted bug (accept every draft) must fail the same test, so the test has power.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

import specd.engine.engine as engine_module
from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.rejection import RejectionResult
from specd.sampling import SamplingTensors, processed_probs
from specd.sampling_params import SamplingParams
from specd.tiny_models.llama import write_tiny_llama

VOCAB = 8
NUM_DRAWS = 20_000
PROMPT = [3, 5, 1]


@pytest.fixture(scope="module")
def tiny_vocab_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vocab")
    # initializer_range 0.5: distributions spread over several tokens, target and draft unlike.
    common = dict(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                  intermediate_size=32, initializer_range=0.5)
    target = write_tiny_llama(root / "target", seed=11, **common)
    draft = write_tiny_llama(root / "draft", seed=12, **common)
    return target, draft


def exact_joint(target_path, params: SamplingParams) -> np.ndarray:
    """P(t1, t2 | PROMPT) under the processed target distribution, [V, V]."""
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    st = SamplingTensors.from_params([params], torch.device("cpu"))
    with torch.no_grad():
        p1 = processed_probs(model(torch.tensor([PROMPT])).logits[0, -1:], st)[0]
        batch = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        p2 = processed_probs(model(batch).logits[:, -1], st.repeat_interleave(torch.full((1,), VOCAB)))
    return (p1[:, None] * p2).double().numpy()


def empirical_joint(target_path, draft_path, params: SamplingParams, k: int) -> np.ndarray:
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=str(draft_path))
    engine = build_engine(target_path, PytorchEngineConfig(max_batch_size=4096, block_size=16), spec)
    draws = [SamplingParams(**{**params.__dict__, "seed": 1000 + i}) for i in range(NUM_DRAWS)]
    seqs = engine.generate([PROMPT] * NUM_DRAWS, draws)
    counts = np.zeros((VOCAB, VOCAB))
    for s in seqs:
        counts[s.output_token_ids[0], s.output_token_ids[1]] += 1
    assert sum(s.stats.num_draft_tokens for s in seqs) > 0
    return counts


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs.ravel() * counts.sum()
    observed = counts.ravel()
    support = expected > 0
    assert observed[~support].sum() == 0, "a token outside the target's support was emitted"
    return chisquare(observed[support], expected[support] * observed[support].sum() / expected[support].sum()).pvalue


SETTINGS = {
    "temperature-1": SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True),
    "top-k-top-p": SamplingParams(temperature=0.9, top_k=5, top_p=0.85, max_new_tokens=4, ignore_eos=True),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_sampling_matches_target_distribution(tiny_vocab_models, setting):
    target, draft = tiny_vocab_models
    params = SETTINGS[setting]
    pvalue = chi_square_pvalue(empirical_joint(target, draft, params, k=2), exact_joint(target, params))
    print(f"{setting}: chi-square p-value {pvalue:.4f} over {NUM_DRAWS} draws")
    assert pvalue > 1e-3


def accept_every_draft(target_probs, draft_token_ids, draft_probs, num_draft_tokens, seeds, positions,
                       one_hot_target=False):
    """The planted bug: drafts are never rejected; the bonus is the target's argmax."""
    batch, max_k = draft_token_ids.shape
    out = torch.full((batch, max_k + 1), -1, dtype=torch.long)
    for i in range(batch):
        k = int(num_draft_tokens[i])
        out[i, :k] = draft_token_ids[i, :k]
        out[i, k] = target_probs[i, k].argmax()
    return RejectionResult(output_token_ids=out, num_accepted=num_draft_tokens.clone(),
                           num_emitted=num_draft_tokens + 1)


def test_planted_bug_fails_the_same_test(tiny_vocab_models, monkeypatch):
    target, draft = tiny_vocab_models
    params = SETTINGS["temperature-1"]
    monkeypatch.setattr(engine_module, "rejection_sample", accept_every_draft)
    pvalue = chi_square_pvalue(empirical_joint(target, draft, params, k=2), exact_joint(target, params))
    print(f"planted bug: chi-square p-value {pvalue:.3g}")
    assert pvalue < 1e-6
