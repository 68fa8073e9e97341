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
from specd.sampling import (SamplingTensors, apply_logit_bias, apply_presence_frequency_penalties,
                            apply_repetition_penalty, processed_probs)
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
    """P(t1, t2 | PROMPT) under the processed target distribution, [V, V]: logit_bias, then the
    repetition penalty over the context and presence / frequency over the output (neutral unless
    the setting names them)."""
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    st = SamplingTensors.from_params([params], torch.device("cpu"))

    def processed(logits: torch.Tensor, outputs: list[list[int]]) -> torch.Tensor:
        rows = st.repeat_interleave(torch.full((1,), len(outputs)))
        logits = apply_logit_bias(logits, [params.logit_bias] * len(outputs))
        logits = apply_repetition_penalty(logits, [torch.tensor(PROMPT + o) for o in outputs], rows.repetition_penalty)
        logits = apply_presence_frequency_penalties(logits, [torch.tensor(o, dtype=torch.long) for o in outputs],
                                                    rows.presence_penalty, rows.frequency_penalty)
        return processed_probs(logits, rows)

    with torch.no_grad():
        p1 = processed(model(torch.tensor([PROMPT])).logits[0, -1:], [[]])[0]
        batch = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        p2 = processed(model(batch).logits[:, -1], [[t] for t in range(VOCAB)])
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
    "penalties-and-bias": SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6,
                                         repetition_penalty=1.2, logit_bias={2: 1.5, 6: -2.0},
                                         max_new_tokens=4, ignore_eos=True),
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


# ---- carried drafts (specd/engine/drafting.py): the draft model asked for drafts past k ---------

def target_tables(target_path, params: SamplingParams) -> list[torch.Tensor]:
    """[P(t1), P(t2 | t1), P(t3 | t1 t2), P(t4 | t1 t2 t3)] after PROMPT, processed: [V]..[V]^4."""
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    st = SamplingTensors.from_params([params], torch.device("cpu"))
    tables, tails = [], [[]]
    for n in range(4):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + t for t in tails])).logits[:, -1]
        tables.append(processed_probs(logits, st.repeat_interleave(torch.full((1,), len(tails))))
                      .view(*([VOCAB] * (n + 1))).double())
        tails = [t + [x] for t in tails for x in range(VOCAB)]
    return tables


def carried_run(target_path, draft_path, params: SamplingParams) -> tuple[list[list[int]], set[int]]:
    """k = 1 with 2 drafts carried: a step that keeps its draft and whose bonus token is the
    draft model's guess hands the next step its draft. Returns every draw's first four tokens and
    the draws whose fourth token came out of a carried draft's step (5 tokens a request: with 4,
    that step would have no room left for a draft)."""
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=1, model=str(draft_path))
    engine = build_engine(target_path, PytorchEngineConfig(max_batch_size=4096, block_size=16), spec)
    engine.drafting.carry = 2
    carried_ids: set[int] = set()
    real_draft = engine.drafting.draft

    def draft(batch, sent_ahead, **kwargs):  # which sequences this step verifies carried drafts for
        before = set(engine.drafting._carried)  # (near the end k = 0 drops them: not those)
        out = real_draft(batch, sent_ahead, **kwargs)
        carried_ids.update(s.seq_id for s, p in zip(batch, out) if s.seq_id in before and p.token_ids.numel())
        return out

    engine.drafting.draft = draft
    draws = [SamplingParams(**{**params.__dict__, "seed": 1000 + i, "max_new_tokens": 5}) for i in range(NUM_DRAWS)]
    seqs = engine.generate([PROMPT] * NUM_DRAWS, draws)
    # k = 1: a carried step follows a step that emitted t2 and t3, so it verifies a draft for t4
    return [s.output_token_ids[:4] for s in seqs], {i for i, s in enumerate(seqs) if s.seq_id in carried_ids}


def carried_pvalues(target_path, draft_path, params: SamplingParams) -> tuple[float, float, int]:
    """(p of all draws' (t3, t4) against the exact marginal, p of the carried draws' t4 against
    the target given each draw's t1..t3, number carried). The second is the sharp one: a
    chi-square over the V values of t4, expected counts summed over the draws' own contexts."""
    p1, p2, p3, p4 = target_tables(target_path, params)
    tokens, carried = carried_run(target_path, draft_path, params)
    joint = (p1[:, None, None, None] * p2[:, :, None, None] * p3[:, :, :, None] * p4).sum(dim=(0, 1))
    counts = np.zeros((VOCAB, VOCAB))
    observed, expected = np.zeros(VOCAB), np.zeros(VOCAB)
    for i, (t1, t2, t3, t4) in enumerate(tokens):
        counts[t3, t4] += 1
        if i in carried:
            observed[t4] += 1
            expected += p4[t1, t2, t3].numpy()
    return chi_square_pvalue(counts, joint.numpy()), chi_square_pvalue(observed, expected), len(carried)


def test_carried_drafts_keep_the_target_distribution(tiny_vocab_models):
    target, draft = tiny_vocab_models
    marginal, carried_p, carried = carried_pvalues(target, draft, SETTINGS["temperature-1"])
    print(f"carried drafts: {carried} draws; chi-square p-values {marginal:.4f} (t3, t4), {carried_p:.4f} "
          f"(carried t4) over {NUM_DRAWS} draws")
    assert carried > NUM_DRAWS // 40
    assert marginal > 1e-3 and carried_p > 1e-3


def test_planted_carry_bug_fails_the_same_test(tiny_vocab_models, monkeypatch):
    """Carried drafts verified against another distribution than the one they were drawn from."""
    import specd.engine.drafting as drafting_module

    class ShiftedRest(drafting_module.DraftProposal):
        def __init__(self, token_ids, probs=None):
            if probs is not None and token_ids.numel() == 1:  # the carried rest at k = 1, carry 2
                probs = probs.roll(1, dims=-1)
            super().__init__(token_ids, probs)

    monkeypatch.setattr(drafting_module, "DraftProposal", ShiftedRest)
    target, draft = tiny_vocab_models
    _, carried_p, carried = carried_pvalues(target, draft, SETTINGS["temperature-1"])
    print(f"planted carry bug: {carried} carried; chi-square p-value {carried_p:.3g}")
    assert carried > NUM_DRAWS // 40 and carried_p < 1e-6
