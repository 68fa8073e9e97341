"""Adaptive draft lengths in the engine (specd/engine/draft_policy.py): a drafter that always
misses ends up not drafting, a perfect one keeps drafting the maximum, output stays the target's
greedy output either way; with adaptation off every step asks the maximum, as a fixed k does.

The cost model is injected (a deterministic default shape that ignores the measured CPU times),
so the choices do not depend on this machine's timings."""

from __future__ import annotations

import random

import pytest

from specd.engine.builder import build_engine
from specd.engine.draft_policy import DraftLengthPolicy
from specd.engine.engine import SpecEngine
from specd.engine.stats import StepTimings
from specd.engine.step_cost import StepCostModel
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.proposers.replay import ReplayProposer, load_references, write_references
from specd.sampling_params import SamplingParams
from tests.engine.draft_costs import FixedCost

K = 3
VOCAB = 512  # the tiny target's
CONFIG = PytorchEngineConfig(max_batch_size=8, block_size=8, session_len=256)


class Recording:
    """A proposer wrapper that keeps every request's asked draft length."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.method, self.hidden_kind = inner.method, inner.hidden_kind
        self.draft_constraints = None
        self.asked: list[tuple[int, int]] = []  # (num_output_tokens, num_draft_tokens) per request
        self.num_calls = 0

    def open(self, seq_id, params, grammar=None):
        self.inner.open(seq_id, params)

    def close(self, seq_id):
        self.inner.close(seq_id)

    def propose(self, requests):
        self.num_calls += 1
        self.asked += [(r.num_output_tokens, r.num_draft_tokens) for r in requests]
        return self.inner.propose(requests)


@pytest.fixture(scope="module")
def case(tiny_models, tmp_path_factory):
    """Prompts, greedy params, the target-only greedy outputs and their replay references."""
    target = tiny_models["target-llama"]
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True) for _ in prompts]
    want = [s.output_token_ids for s in build_engine(target, CONFIG).generate(prompts, params)]
    path = tmp_path_factory.mktemp("refs") / "refs.jsonl"
    write_references(path, list(zip(prompts, want)))
    return target, prompts, params, want, load_references(path)


def engine_over(case, corrupt_rate: float, *, adaptive: bool = True, depth_share: float = 0.3):
    target, prompts, params, want, refs = case
    proposer = Recording(ReplayProposer(refs, VOCAB, corrupt_rate))
    plain = build_engine(target, CONFIG)  # the target runner, reused under a speculative engine
    policy = DraftLengthPolicy(K, adaptive=adaptive, method="replay",
                               cost=FixedCost(K, depth_share=depth_share))
    engine = SpecEngine(plain.runner, proposer, K, max_batch_size=CONFIG.max_batch_size,
                        max_model_len=plain.max_model_len, draft_policy=policy)
    return engine, proposer


def test_a_drafter_that_always_misses_stops_drafting(case):
    _, prompts, params, want, _ = case
    engine, proposer = engine_over(case, 1.0)
    got = engine.generate(prompts, params)
    assert [s.output_token_ids for s in got] == want
    counts = engine.stats.draft_length_counts
    total = sum(counts)
    print(f"always missing: chosen k counts {counts}, {engine.stats.num_undrafted_steps} of "
          f"{engine.stats.num_steps} steps undrafted")
    assert counts[0] >= 0.7 * total
    assert engine.stats.num_undrafted_steps >= engine.stats.num_steps // 2
    assert all(s.stats.num_zero_draft_steps > 0 for s in got)
    assert all(s.stats.mean_draft_length < 1.0 for s in got)
    # A step where nobody drafts asks the drafter nothing: the tokens wait for its next request.
    assert proposer.num_calls <= engine.stats.num_steps - engine.stats.num_undrafted_steps


def test_a_perfect_drafter_keeps_the_maximum(case):
    _, prompts, params, want, _ = case
    engine, _ = engine_over(case, 0.0)
    got = engine.generate(prompts, params)
    assert [s.output_token_ids for s in got] == want
    counts = engine.stats.draft_length_counts
    print(f"perfect drafter: chosen k counts {counts}")
    assert counts[K] >= 0.8 * sum(counts)
    assert counts[0] <= len(prompts)  # a request's last token: no budget left


def test_a_drafter_that_misses_drafts_again_where_drafting_is_cheap(case):
    """At a flat cost (drafting nearly free) even rare hits pay: the same drafter keeps drafting."""
    _, prompts, params, want, _ = case
    engine, _ = engine_over(case, 1.0, depth_share=0.001)
    got = engine.generate(prompts, params)
    assert [s.output_token_ids for s in got] == want
    assert engine.stats.draft_length_counts[0] <= len(prompts)  # a request's last token: no budget left


def test_off_asks_the_maximum_as_a_fixed_k(case):
    """Adaptation off: every request asks min(K, what its budget leaves) drafts, the fixed-k
    engine's lengths; on, with the same always-missing drafter, far fewer."""
    _, prompts, params, want, _ = case
    engine, proposer = engine_over(case, 1.0, adaptive=False)
    got = engine.generate(prompts, params)
    assert [s.output_token_ids for s in got] == want
    budget = params[0].max_new_tokens
    assert proposer.asked and all(k == max(0, min(K, budget - n - 1)) for n, k in proposer.asked)
    fixed = sum(k for _, k in proposer.asked)
    adaptive, recorded = engine_over(case, 1.0)
    adaptive.generate(prompts, params)
    assert sum(k for _, k in recorded.asked) < fixed / 2


def test_the_speculative_config_switch_reaches_the_engine(tiny_models):
    target = tiny_models["target-llama"]
    on = build_engine(target, CONFIG, SpeculativeConfig(method="ngram", num_speculative_tokens=K))
    off = build_engine(target, CONFIG, SpeculativeConfig(method="ngram", num_speculative_tokens=K, adaptive=False))
    assert on.draft_policy.adaptive and not off.draft_policy.adaptive
    assert on.draft_policy.prior.mean == pytest.approx(0.5)  # ngram's prior
    assert not build_engine(target, CONFIG).draft_policy.adaptive  # no proposer: nothing to adapt


@pytest.mark.measured_draft_costs
def test_measured_costs_keep_the_output(case):
    """The engine's own cost model, measured on this machine's steps: whatever k it picks, greedy
    output is the target's; warm-up leaves it measured at the full length and at none."""
    from specd.engine.warm_up import warm_up_engine

    target, prompts, params, want, refs = case
    plain = build_engine(target, CONFIG)
    for rate in (0.0, 1.0):
        engine = SpecEngine(plain.runner, Recording(ReplayProposer(refs, VOCAB, rate)), K,
                            max_batch_size=CONFIG.max_batch_size, max_model_len=plain.max_model_len)
        assert type(engine.draft_policy.cost) is StepCostModel
        warm_up_engine(engine)
        cost = engine.draft_policy.cost
        assert cost.num_observed > 0 and cost._draft[0] is not None and cost._draft[K] is not None
        assert [s.output_token_ids for s in engine.generate(prompts, params)] == want
        print(f"measured, corrupt rate {rate}: chosen k counts {engine.stats.draft_length_counts}")


def test_probes_draft_one_token_at_k_zero():
    """Every probe_every steps a sequence at k = 0 drafts one (within its cap)."""
    policy = DraftLengthPolicy(K, cost=FixedCost(K, depth_share=10.0), probe_every=4)
    seen = []
    for _ in range(8):
        seen.append(policy.plan({1: K, 2: 0}))
        policy.drafted(2, 0)
        policy.observe_timings(StepTimings(), 0.0)
    assert [ks[1] for ks in seen] == [0, 0, 0, 1, 0, 0, 0, 1]
    assert all(ks[2] == 0 for ks in seen)


def test_tensor_parallel_ranks_keep_the_default_costs():
    """Each rank's clock differs; a measured model would let ranks pick different k and break the
    group's collectives, so a policy that does not measure keeps choosing from the default shape."""
    measured, frozen = (DraftLengthPolicy(3, method="eagle3", cost=StepCostModel(3), measure_costs=m)
                        for m in (True, False))
    caps = {0: 3, 1: 3}
    for policy in (measured, frozen):
        policy.plan(caps)
        policy.drafted(8, 3)
        policy.observe_timings(StepTimings(draft=0.5, verify=0.001), 0.6)
    assert frozen.cost.num_observed == 0 and measured.cost.num_observed == 1
