"""presence_penalty, frequency_penalty and logit_bias under speculation: greedy output is token for
token the target-only output with the same settings, for every method (the penalties of a verified
row count the drafts before it), and the settings act (a banned token never appears, a forced one
always does). The sampled distribution is tested in test_sampling_lossless.py."""

from __future__ import annotations

import pytest

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.sampling_params import SamplingParams
from tests.engine.test_greedy_lossless import METHODS, NUM_PROMPTS, make_requests

CONFIG = PytorchEngineConfig(max_batch_size=NUM_PROMPTS, block_size=8)


def with_penalties(params: list[SamplingParams]) -> list[SamplingParams]:
    """Strong settings, different per request (some neutral), so a row penalised over the wrong
    history picks another token."""
    out = []
    for i, p in enumerate(params):
        extra = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, logit_bias={7: 4.0, 9: -100}),
                 dict(frequency_penalty=0.8, presence_penalty=-0.5, repetition_penalty=1.3), {}][i % 4]
        out.append(SamplingParams(**{**p.__dict__, **extra, "max_new_tokens": 24}))
    return out


def outputs(target, spec, prompts, params):
    seqs = build_engine(target, CONFIG, spec).generate(prompts, params)
    return [(s.output_token_ids, s.finish_reason) for s in seqs], sum(s.stats.num_draft_tokens for s in seqs)


@pytest.mark.parametrize("method", list(METHODS))
def test_penalised_greedy_output_is_the_targets_own(tiny_models, method):
    target_name, draft_name = METHODS[method]
    target = tiny_models[target_name]
    draft = tiny_models[draft_name] if draft_name else None
    vocab = 512
    prompts, params = make_requests(vocab, seed=11)
    params = with_penalties(params)
    want, _ = outputs(target, None, prompts, params)
    plain, _ = outputs(target, None, prompts, [SamplingParams(**{**p.__dict__, "frequency_penalty": 0.0,
                                                                 "presence_penalty": 0.0, "logit_bias": {},
                                                                 "repetition_penalty": 1.0}) for p in params])
    assert sum(w != p for w, p in zip(want, plain)) >= NUM_PROMPTS // 2  # the settings change the output
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, model=str(draft) if draft else "")
    got, num_drafts = outputs(target, spec, prompts, params)
    assert got == want and num_drafts > 0


def test_logit_bias_bans_and_forces_tokens(tiny_models):
    target = tiny_models["target-llama"]
    prompt = [5, 6, 7, 8, 9]
    base = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    [(plain, _)], _ = outputs(target, None, [prompt], [base])
    banned = sorted(set(plain))
    [(out, _)], _ = outputs(target, None, [prompt], [SamplingParams(**{**base.__dict__,
                                                                    "logit_bias": {t: -100 for t in banned}})])
    assert not set(out) & set(banned)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    [(forced, _)], _ = outputs(target, spec, [prompt], [SamplingParams(**{**base.__dict__, "logit_bias": {42: 100}})])
    assert forced == [42] * 12


def test_drafts_of_the_penalised_output_are_all_kept(tiny_models):
    """A drafter that proposes the target's own penalised output (replay): every draft is the
    target's token only if each verified row is penalised over the drafts before it as well."""
    from specd.proposers.replay import ReplayProposer

    target = tiny_models["target-llama"]
    prompts, params = make_requests(512, seed=12)
    params = with_penalties(params)
    want, _ = outputs(target, None, prompts, params)
    proposer = ReplayProposer({tuple(p): w[0] for p, w in zip(prompts, want)}, vocab_size=512)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    engine = build_engine(target, CONFIG, spec, proposer=proposer)
    seqs = engine.generate(prompts, params)
    assert [(s.output_token_ids, s.finish_reason) for s in seqs] == want
    drafted = sum(s.stats.num_draft_tokens for s in seqs)
    assert drafted > 0 and sum(s.stats.num_accepted_tokens for s in seqs) == drafted
