"""The draft-length chooser (specd/engine/draft_lengths.py): per sequence, the k that maximise the
batch's expected tokens per second of step, k = 0 everywhere when no drafting pays."""

from __future__ import annotations

import numpy as np
import pytest

from specd.engine.draft_lengths import choose_draft_lengths

K = 4


def chain(p: float, k: int = K) -> list[float]:
    """Cumulative acceptance of a chain whose every draft is kept with probability p."""
    return [p ** (j + 1) for j in range(k)]


def linear_cost(base: float = 1.0, per_token: float = 0.0, per_depth: float = 0.0):
    return lambda tokens, depth: base + per_token * np.asarray(tokens, dtype=np.float64) + per_depth * depth


def expected_rate(cumulative, ks, cost) -> float:
    tokens = sum(1 + sum(c[:k]) for c, k in zip(cumulative, ks))
    return tokens / float(cost(np.array([len(ks) + sum(ks)]), max(ks))[0])


def test_all_misses_draft_nothing():
    cum = [chain(0.02) for _ in range(8)]
    assert choose_draft_lengths(cum, [K] * 8, linear_cost(per_depth=0.1)) == [0] * 8


def test_high_acceptance_at_a_flat_cost_drafts_the_maximum():
    cum = [chain(0.9) for _ in range(8)]
    assert choose_draft_lengths(cum, [K] * 8, linear_cost(per_depth=0.01)) == [K] * 8


def test_caps_bound_each_sequence():
    cum = [chain(0.9) for _ in range(3)]
    assert choose_draft_lengths(cum, [K, 2, 0], linear_cost()) == [K, 2, 0]


def test_a_steep_per_token_cost_at_a_large_batch_drafts_less():
    """A large batch on a compute-bound target: each query token costs; deep drafts (kept with a
    small chance) no longer pay while the first ones still do."""
    batch = 128
    cum = [chain(0.7) for _ in range(batch)]
    flat = choose_draft_lengths(cum, [K] * batch, linear_cost(per_token=1e-4))
    steep = choose_draft_lengths(cum, [K] * batch, linear_cost(per_token=1 / batch))
    assert flat == [K] * batch
    assert 0 < max(steep) < K and sum(steep) < sum(flat)


def test_a_mixed_batch_drafts_per_sequence():
    """Good drafters keep drafting deep, a bad one drafts nothing, in the same step."""
    cum = [chain(0.9), chain(0.05), chain(0.9), chain(0.6)]
    ks = choose_draft_lengths(cum, [K] * 4, linear_cost(per_token=0.05))
    assert ks[1] == 0 and ks[0] == ks[2] > 0 and ks[0] >= ks[3]


@pytest.mark.parametrize("seed", range(20))
def test_the_choice_is_no_worse_than_the_maximum_or_nothing(seed):
    """Against the two fixed plans (k = 0, k = K), on random batches and costs."""
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 12))
    cum = [chain(float(rng.uniform(0.0, 1.0))) for _ in range(batch)]
    cost = linear_cost(per_token=float(rng.uniform(0, 0.2)), per_depth=float(rng.uniform(0, 0.5)))
    ks = choose_draft_lengths(cum, [K] * batch, cost)
    best = expected_rate(cum, ks, cost)
    assert best >= expected_rate(cum, [0] * batch, cost) - 1e-12
    assert best >= expected_rate(cum, [K] * batch, cost) - 1e-12


def test_the_margin_keeps_marginal_drafting_off():
    cum = [chain(0.1) for _ in range(4)]
    cost = linear_cost(per_depth=0.05)
    assert max(choose_draft_lengths(cum, [K] * 4, cost)) > 0
    assert choose_draft_lengths(cum, [K] * 4, cost, margin=0.2) == [0] * 4


def test_an_empty_batch():
    assert choose_draft_lengths([], [], linear_cost()) == []


def test_one_sequence_plans_as_the_batch_chooser_does():
    """The policy's batch-1 path (plain floats) picks the chooser's k, with measured costs too."""
    from specd.engine.draft_policy import DraftLengthPolicy
    from specd.engine.stats import StepTimings

    rng = np.random.default_rng(5)
    for trial in range(40):
        policy = DraftLengthPolicy(K, method="eagle3", margin=float(rng.uniform(0, 0.1)))
        for _ in range(int(rng.integers(0, 12))):  # measured verify and draft costs, at random shapes
            t, d = int(rng.integers(1, 9)), int(rng.integers(0, K + 1))
            policy.drafted(t, d)
            step = StepTimings()
            step.verify, step.draft = float(rng.uniform(1e-3, 5e-3)), float(rng.uniform(0, 2e-3)) * d
            policy.observe_timings(step, step.verify + step.draft + float(rng.uniform(0, 1e-3)))
        policy.observe_verdicts([0], [K], [int(rng.integers(0, K + 1))])
        cap = int(rng.integers(0, K + 1))
        want = choose_draft_lengths(policy._estimates.cumulative([0]), [cap], policy.cost.step_seconds,
                                    margin=policy.margin)
        assert [policy.plan({0: cap})[0]] == want, trial
