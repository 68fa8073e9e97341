"""Logprobs under speculation equal target-only decoding's (specd/engine/logprobs.py).

Greedy: for every method, the speculative run's tokens are the target-only run's, and so must be
each token's logprob and top-N (ids and values, within 1e-4), raw and processed, with and
without a grammar. Sampled (seeded): speculative tokens differ from target-only ones, so both runs
are checked against the target teacher-forced over their own tokens (one forward over prompt +
output, processed row by row with the request's settings): the logprobs target-only decoding
gives any prefix. The overlapped decode path gives the synchronous loop's logprobs.
"""

from __future__ import annotations

import math

import pytest
import torch

from specd.engine.builder import build_engine
from specd.grammar.backend import GrammarSpec
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.models.base import SequenceChunk
from specd.sampling import (SamplingTensors, apply_logit_bias, apply_presence_frequency_penalties,
                            apply_repetition_penalty, processed_probs)
from specd.sampling_params import SamplingParams
from tests.engine.test_greedy_lossless import METHODS, NUM_PROMPTS, make_requests
from tests.engine.test_overlapped_decode import CountingRunner, HostTokensRunner, engine_over
from tests.engine.test_structured_lossless import constrained_engine, grammars

CONFIG = PytorchEngineConfig(max_batch_size=NUM_PROMPTS, block_size=8)
TOLERANCE = 1e-4
# per request: (logprobs, mode); every third request asks for nothing (and must get nothing)
ASKS = [(5, "raw"), (0, "processed"), None, (3, "processed"), (20, "raw"), None, (1, "raw"), (2, "processed")]


def asking(params: list[SamplingParams], **extra) -> list[SamplingParams]:
    out = []
    for p, ask in zip(params, ASKS):
        fields = {**p.__dict__, **extra}
        if ask is not None:
            fields.update(logprobs=ask[0], logprobs_mode=ask[1])
        out.append(SamplingParams(**fields))
    return out


def sampled(params: list[SamplingParams]) -> list[SamplingParams]:
    """Seeded sampling with the filters and penalties on some requests (processed mode sees them)."""
    extras = [dict(top_k=8), dict(top_p=0.8, repetition_penalty=1.3), dict(min_p=0.05, frequency_penalty=0.7),
              dict(logit_bias={7: 3.0, 9: -100}, presence_penalty=0.5), {}]
    return [SamplingParams(**{**p.__dict__, "temperature": 0.9, "seed": 100 + i, **extras[i % len(extras)]})
            for i, p in enumerate(params)]


def spec_config(tiny_models, method: str, k: int = 3) -> SpeculativeConfig:
    draft_name = METHODS[method][1]
    return SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=False,
                             model=str(tiny_models[draft_name]) if draft_name else "")


def assert_speculated(method: str, seqs, accepting=("ngram", "eagle3")) -> None:
    """Drafts were verified; where the tiny drafter agrees with the target at all (n-gram lookup,
    EAGLE-3), some were accepted, so rows past 0 carried emitted tokens."""
    assert sum(s.stats.num_draft_tokens for s in seqs) > 0, "speculation never ran"
    if method in accepting:
        assert sum(s.stats.num_accepted_tokens for s in seqs) > 0, "no draft accepted"


def assert_logprobs_equal(got, want, where: str) -> None:
    """got, want: Sequences over the same tokens. Logprobs within TOLERANCE, the same top ids (a
    near-tie within TOLERANCE may swap places)."""
    assert got.output_token_ids == want.output_token_ids, f"{where}: tokens differ"
    if want.params.logprobs is None:
        assert got.output_logprobs == [] and want.output_logprobs == [], where
        return
    assert len(got.output_logprobs) == len(got.output_token_ids), f"{where}: one logprob per token"
    for j, (g, w) in enumerate(zip(got.output_logprobs, want.output_logprobs)):
        assert close(g.logprob, w.logprob), f"{where} token {j}: {g.logprob} != {w.logprob}"
        assert len(g.top) == len(w.top) == want.params.logprobs, f"{where} token {j}: top-N length"
        assert all(close(a[1], b[1]) for a, b in zip(g.top, w.top)), f"{where} token {j}: {g.top} != {w.top}"
        assert [t for t, _ in g.top] == [t for t, _ in w.top] or {t for t, _ in g.top} == {t for t, _ in w.top}, \
            f"{where} token {j}: top ids {g.top} != {w.top}"
        values = [lp for _, lp in g.top]
        assert values == sorted(values, reverse=True), f"{where} token {j}: top-N not by logprob desc"


def close(a: float, b: float) -> bool:
    return (math.isinf(a) and a == b) or abs(a - b) <= TOLERANCE


def teacher_forced(runner, seq) -> list[tuple[float, list[tuple[int, float]]]]:
    """The target's logprobs of seq's own tokens, from one forward over prompt + output: raw
    log_softmax, or the processed distribution (bias, penalties over the prefix, filters)."""
    prompt, output, params = seq.prompt_token_ids, seq.output_token_ids, seq.params
    runner.add_sequence(10_000)
    try:
        out = runner.forward([SequenceChunk(10_000, prompt + output[:-1])])
        logits = out.logits[len(prompt) - 1:].float()  # [len(output), V]: row j predicts output[j]
    finally:
        runner.free(10_000)
    if params.logprobs_mode == "raw":
        lp = torch.log_softmax(logits, dim=-1)
    else:
        n = len(output)
        st = SamplingTensors.from_params([params] * n)
        logits = apply_logit_bias(logits, [params.logit_bias] * n)
        logits = apply_repetition_penalty(logits, [torch.tensor(prompt + output[:j]) for j in range(n)],
                                          st.repetition_penalty)
        logits = apply_presence_frequency_penalties(
            logits, [torch.tensor(output[:j], dtype=torch.long) for j in range(n)], st.presence_penalty,
            st.frequency_penalty)
        lp = processed_probs(logits, st).log()
    rows = []
    for j, token in enumerate(output):
        top = lp[j].topk(params.logprobs)
        rows.append((lp[j, token].item(), list(zip(top.indices.tolist(), top.values.tolist()))))
    return rows


def assert_matches_teacher_forced(runner, seq, where: str) -> None:
    if seq.params.logprobs is None:
        assert seq.output_logprobs == [], where
        return
    assert len(seq.output_logprobs) == len(seq.output_token_ids), where
    for j, (got, (lp, top)) in enumerate(zip(seq.output_logprobs, teacher_forced(runner, seq))):
        assert close(got.logprob, lp), f"{where} token {j}: {got.logprob} != {lp}"
        # (finite alternatives only: teacher forcing's topk orders -inf ties arbitrarily)
        finite = [(t, v) for t, v in top if not math.isinf(v)]
        assert [t for t, _ in got.top[:len(finite)]] == [t for t, _ in finite] or \
            {t for t, _ in got.top[:len(finite)]} == {t for t, _ in finite}, f"{where} token {j}: {got.top} != {top}"
        assert all(close(a[1], b[1]) for a, b in zip(got.top, top)), f"{where} token {j}: {got.top} != {top}"


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_logprobs_equal_target_only(tiny_models, method):
    target = tiny_models[METHODS[method][0]]
    prompts, params = make_requests(512, seed=3)
    params = asking(params)
    want = build_engine(target, CONFIG).generate(prompts, params)
    engine = build_engine(target, CONFIG, spec_config(tiny_models, method))
    got = engine.generate(prompts, params)
    assert_speculated(method, got)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_logprobs_equal(g, w, f"{method} request {i}")
    for i, w in enumerate(want):  # and the reference is the target's own
        assert_matches_teacher_forced(engine.runner, w, f"target-only request {i}")
    processed = next(w for w in want if w.params.logprobs_mode == "processed" and w.params.logprobs)
    assert all(e.logprob == 0.0 and math.isinf(e.top[-1][1]) for e in processed.output_logprobs), \
        "greedy processed rows are one-hot"


@pytest.mark.parametrize("method", list(METHODS))
def test_sampled_logprobs_are_the_targets(tiny_models, method):
    target = tiny_models[METHODS[method][0]]
    prompts, params = make_requests(512, seed=4)
    params = asking(sampled(params))
    engine = build_engine(target, CONFIG, spec_config(tiny_models, method))
    got = engine.generate(prompts, params)
    assert_speculated(method, got, accepting=("eagle3",))  # (sampled n-gram drafts miss the tiny target)
    want = build_engine(target, CONFIG).generate(prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_matches_teacher_forced(engine.runner, g, f"{method} request {i}")
        assert_matches_teacher_forced(engine.runner, w, f"target-only request {i}")
        if g.params.logprobs is not None:  # the first token comes from the prefill: the same
            assert g.output_token_ids[0] == w.output_token_ids[0]
            assert close(g.output_logprobs[0].logprob, w.output_logprobs[0].logprob)


@pytest.mark.parametrize("method", ["eagle3", "ngram", "deepseek_mtp"])
def test_constrained_logprobs_equal_target_only(tiny_models, method):
    target = tiny_models[METHODS[method][0]]
    specs: list[GrammarSpec | None] = grammars()[:4]
    specs = specs + [None] * (len(ASKS) - len(specs))
    prompts = [[5 + i, 9, 13 + 2 * i] * (1 + i % 2) for i in range(len(specs))]
    params = asking([SamplingParams(max_new_tokens=32) for _ in specs])
    want = constrained_engine(target, None).generate(prompts, params, specs)
    got = constrained_engine(target, spec_config(tiny_models, method)).generate(prompts, params, specs)
    assert_speculated(method, got)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_logprobs_equal(g, w, f"{method} constrained request {i}")
    # processed rows see the grammar's mask: a constrained greedy row's excluded tokens are -inf
    constrained = [w for w, s in zip(want, specs) if s is not None and w.params.logprobs_mode == "processed"]
    assert any(math.isinf(e.top[-1][1]) for w in constrained for e in w.output_logprobs if e.top)


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_overlapped_decode_keeps_logprobs(tiny_models, sampling):
    """Requests asking for logprobs take the synchronous step; those that do not overlap once
    they are alone. Tokens and logprobs equal the synchronous loop's."""
    target = tiny_models["target-llama"]
    prompts, params = make_requests(512, seed=6)
    params = [SamplingParams(**{**p.__dict__, "max_new_tokens": 24, "stop_token_ids": []}) for p in params]
    if sampling:
        params = [SamplingParams(**{**p.__dict__, "temperature": 0.8, "seed": 7 + i}) for i, p in enumerate(params)]
    # two ask, with short outputs: the others decode on, overlapped, after they finish
    params = [SamplingParams(**{**p.__dict__, "logprobs": 2, "max_new_tokens": 6}) if i in (1, 6) else p
              for i, p in enumerate(params)]
    reference = engine_over(HostTokensRunner, target, static=False)
    want = reference.generate(prompts, params)
    engine = engine_over(CountingRunner, target, static=False)
    engine.max_batch_size = 4  # later admissions (one asking) join while a step is in flight
    got = engine.generate(prompts, params)
    assert engine.runner.num_carried_forwards > 0, "no step overlapped"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_logprobs_equal(g, w, f"overlap request {i}")
        if g.params.logprobs is not None:
            assert all(e is not None for e in g.output_logprobs)


def test_resumed_request_keeps_alignment(tiny_models):
    """A request resumed with tokens another engine emitted has no logprobs for those (None
    placeholders keep the list aligned) and the target's for the rest."""
    target = tiny_models["target-llama"]
    params = SamplingParams(max_new_tokens=10, logprobs=2, ignore_eos=True)
    [full] = build_engine(target, CONFIG).generate([[5, 6, 7]], [params])
    engine = build_engine(target, CONFIG)
    seq = engine.add_request([5, 6, 7], params, output_token_ids=full.output_token_ids[:4])
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == full.output_token_ids
    assert seq.output_logprobs[:4] == [None] * 4
    for g, w in zip(seq.output_logprobs[4:], full.output_logprobs[4:]):
        assert close(g.logprob, w.logprob) and [t for t, _ in g.top] == [t for t, _ in w.top]
