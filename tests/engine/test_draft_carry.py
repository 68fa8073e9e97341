"""Carried drafts (specd/engine/drafting.py): a request asks for drafts past k; after a step that
keeps all k and whose bonus token is the drafter's guess, the next step verifies the rest without
asking the drafter. Greedy output stays the target's exactly; fewer requests reach the drafter.
(The sampled case: tests/engine/test_sampling_lossless.py, carried drafts of a draft model.)"""

from __future__ import annotations

import random

import pytest
import torch

from specd.engine.builder import build_engine
from specd import settings
from specd.engine.drafting import Drafting, default_carry

CARRY_ENV = settings.DRAFT_CARRY.name
from specd.engine.sequence import Sequence
from specd.messages import SpeculativeConfig
from specd.proposers.base import DraftProposal
from specd.proposers.replay import ReplayProposer, corrupt_rate_for, load_references, write_references
from specd.sampling_params import SamplingParams
from tests.engine.test_draft_ahead import CONFIG, AsyncNgram

K = 3
VOCAB = 512  # the tiny target's


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models["target-llama"]


def async_engine(target, inner, carry: int):
    """An engine over `inner` behind propose_async (the remote drafters' shape), carry set."""
    proposer = AsyncNgram(inner)  # the wrapper is generic: it counts the calls of any proposer
    engine = build_engine(target, CONFIG, SpeculativeConfig(method="ngram", num_speculative_tokens=K),
                          proposer=proposer)
    engine.drafting.carry = carry
    return engine, proposer


@pytest.mark.parametrize("rate", [0.0, corrupt_rate_for(3.0, K)])
def test_carried_drafts_keep_the_targets_greedy_output_with_fewer_requests(target, tmp_path, rate):
    """The replay drafter (the target's own greedy continuation, corrupted at `rate`): at rate 0
    every step keeps all k and the guess, so with k + 1 drafts carried every other step is
    carried, and with 2(k + 1) (a carried step carries the rest on) nearly every step; at
    acceptance length 3 about 0.81^4 of the steps qualify. Output, acceptance: as without."""
    rng = random.Random(7)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(3, 20))] for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True) for _ in prompts]
    want = [s.output_token_ids for s in build_engine(target, CONFIG).generate(prompts, params)]
    write_references(tmp_path / "refs.jsonl", list(zip(prompts, want)))
    refs = load_references(tmp_path / "refs.jsonl")
    runs = {}
    for carry in (2 * (K + 1), K + 1, 0):
        engine, proposer = async_engine(target, ReplayProposer(refs, VOCAB, rate), carry)
        got = engine.generate(prompts, params)
        assert [s.output_token_ids for s in got] == want
        drafts = sum(s.stats.num_drafts for s in got)
        runs[carry] = (engine.drafting.num_carried, sum(len(ids) for ids in proposer.sent_ahead) + proposer.num_sync,
                       1 + sum(s.stats.num_accepted_tokens for s in got) / drafts, drafts)
    (carried, requests, length, steps), (none, plain_requests, plain_length, plain_steps) = runs[K + 1], runs[0]
    deep_carried, deep_requests, deep_length, deep_steps = runs[2 * (K + 1)]
    print(f"rate {rate:.3f}: carried {carried} of {steps} sequence-steps ({deep_carried} of {deep_steps} "
          f"carrying two steps' worth); requests {requests} ({deep_requests}) against {plain_requests}; "
          f"acceptance length {length:.2f} ({deep_length:.2f}) against {plain_length:.2f}")
    assert none == 0 and carried > 0
    assert deep_requests <= requests < plain_requests and deep_carried >= carried
    if rate == 0.0:
        assert carried >= steps // 2 - len(prompts)  # every other step, but near a sequence's end
        # each request's drafts last three steps (k + 2(k + 1) = 11 drafts, 4 tokens a step)
        assert deep_carried >= 2 * deep_steps // 3 - 2 * len(prompts)
    for other in (length, deep_length):
        assert abs(other - plain_length) < 0.35  # carried drafts are the drafter's own, as good


def seq_with(seq_id: int) -> Sequence:
    return Sequence(seq_id, [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=100))


def test_settle_carries_only_after_all_drafts_kept_and_the_guess_right():
    drafting = Drafting(None, lambda seq: 2, ahead=False, carry=3)
    chain = DraftProposal(torch.tensor([10, 11, 12, 13, 14]), torch.rand(5, 20))
    cases = [  # (accepted, emitted, carried?)
        (2, [10, 11, 12], True),  # both drafts kept, bonus = the guess 12
        (2, [10, 11, 9], False),  # the guess was wrong
        (1, [10, 7], False),  # a draft rejected
        (2, [10, 11], False),  # stopped before the bonus
    ]
    for seq_id, (accepted, emitted, carried) in enumerate(cases):
        seq = seq_with(seq_id)
        used = drafting._split(seq, chain)
        assert used.token_ids.tolist() == [10, 11] and torch.equal(used.probs, chain.probs[:2])
        drafting.settle(seq, 2, accepted, emitted)
        assert (seq_id in drafting._carried) == carried
    rest = drafting._carried[0]
    assert rest.token_ids.tolist() == [13, 14] and torch.equal(rest.probs, chain.probs[3:])


def test_default_carry(monkeypatch, target):
    monkeypatch.delenv(CARRY_ENV, raising=False)
    local = build_engine(target, CONFIG, SpeculativeConfig(method="ngram", num_speculative_tokens=K))
    assert local.drafting.carry == 0
    assert default_carry(local.proposer, K) == 0  # in-process: no round trip to save
    assert default_carry(AsyncNgram(local.proposer), K) == 2 * (K + 1)
    monkeypatch.setenv(CARRY_ENV, "0")
    assert default_carry(AsyncNgram(local.proposer), K) == 0
    with pytest.raises(ValueError, match="carry"):
        Drafting(None, lambda seq: K, ahead=False, carry=-1)
