"""Per-request acceptance estimates (specd/engine/acceptance_estimate.py): a prior per method,
per-position conditional evidence, decay back toward the prior."""

from __future__ import annotations

import pytest

from specd.engine.acceptance_estimate import METHOD_PRIOR_MEANS, AcceptanceEstimate, AcceptancePrior


def test_without_evidence_the_prior():
    est = AcceptanceEstimate(3, AcceptancePrior(mean=0.6))
    assert est.conditional() == pytest.approx([0.6] * 3)
    assert est.cumulative() == pytest.approx([0.6, 0.36, 0.216])


def test_the_prior_is_per_method():
    assert AcceptancePrior.for_method("ngram").mean == METHOD_PRIOR_MEANS["ngram"]
    assert AcceptancePrior.for_method(None).mean == AcceptancePrior().mean
    with pytest.raises(ValueError, match="decay"):
        AcceptancePrior(decay=0.0)


def test_evidence_is_conditional_per_position():
    """Kept 2 of 3 drafts every step: positions 0 and 1 always kept, position 2 always rejected,
    and no position past the first rejection counts as tried."""
    est = AcceptanceEstimate(4, AcceptancePrior(mean=0.5, strength=1.0, decay=1.0))
    for _ in range(20):
        est.observe(3, 2)
    p = est.conditional()
    assert p[0] == p[1] == pytest.approx(20.5 / 21)
    assert p[2] == pytest.approx(0.5 / 21)
    assert p[3] == pytest.approx(0.5)  # never drafted: the prior
    c = est.cumulative()
    assert c[1] == pytest.approx(p[0] * p[1]) and c[3] == pytest.approx(c[2] * 0.5)


def test_a_step_without_drafts_only_decays():
    est = AcceptanceEstimate(2, AcceptancePrior(mean=0.5, strength=1.0, decay=1.0, idle_decay=1.0))
    est.observe(2, 0)
    before = est.conditional()
    est.observe(0, 0)
    assert est.conditional() == before


def test_misses_decay_back_toward_the_prior():
    """A request whose drafts all missed looks hopeless, then, steps without drafts later, close to
    the prior again: it is drafted again (re-probed)."""
    prior = AcceptancePrior(mean=0.7, strength=2.0, decay=0.9, idle_decay=0.9)
    est = AcceptanceEstimate(3, prior)
    for _ in range(30):
        est.observe(3, 0)
    low = est.conditional()[0]
    assert low < 0.15
    trail = [low]
    for _ in range(60):
        est.observe(0, 0)
        trail.append(est.conditional()[0])
    assert all(a <= b for a, b in zip(trail, trail[1:]))  # monotone, toward the prior
    assert trail[-1] == pytest.approx(0.7, abs=0.02)


def test_recent_steps_weigh_more():
    est = AcceptanceEstimate(1, AcceptancePrior(mean=0.5, decay=0.8))
    for _ in range(30):
        est.observe(1, 1)
    for _ in range(10):
        est.observe(1, 0)
    assert est.conditional()[0] < 0.5  # ten recent misses outweigh thirty older hits
