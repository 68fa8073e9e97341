"""Per-request acceptance estimates (specd/engine/acceptance_estimate.py): a prior per method,
per-position conditional evidence, decay back toward the prior."""

from __future__ import annotations

import pytest

import numpy as np

from specd.engine.acceptance_estimate import METHOD_PRIOR_MEANS, AcceptanceEstimates, AcceptancePrior


class One:
    """One request's row of the table, as the tests below read it."""

    def __init__(self, max_depth: int, prior: AcceptancePrior) -> None:
        self.table = AcceptanceEstimates(max_depth, prior)

    def observe(self, drafted: int, accepted: int) -> None:
        self.table.observe([7], [drafted], [accepted])

    def conditional(self) -> list[float]:
        return self.table.conditional([7])[0].tolist()

    def cumulative(self) -> list[float]:
        return self.table.cumulative([7])[0].tolist()


def test_without_evidence_the_prior():
    est = One(3, AcceptancePrior(mean=0.6))
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
    est = One(4, AcceptancePrior(mean=0.5, strength=1.0, decay=1.0))
    for _ in range(20):
        est.observe(3, 2)
    p = est.conditional()
    assert p[0] == p[1] == pytest.approx(20.5 / 21)
    assert p[2] == pytest.approx(0.5 / 21)
    assert p[3] == pytest.approx(0.5)  # never drafted: the prior
    c = est.cumulative()
    assert c[1] == pytest.approx(p[0] * p[1]) and c[3] == pytest.approx(c[2] * 0.5)


def test_a_step_without_drafts_only_decays():
    est = One(2, AcceptancePrior(mean=0.5, strength=1.0, decay=1.0, idle_decay=1.0))
    est.observe(2, 0)
    before = est.conditional()
    est.observe(0, 0)
    assert est.conditional() == before


def test_misses_decay_back_toward_the_prior():
    """A request whose drafts all missed looks hopeless, then, steps without drafts later, close to
    the prior again: it is drafted again (re-probed)."""
    prior = AcceptancePrior(mean=0.7, strength=2.0, decay=0.9, idle_decay=0.9)
    est = One(3, prior)
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
    est = One(1, AcceptancePrior(mean=0.5, decay=0.8))
    for _ in range(30):
        est.observe(1, 1)
    for _ in range(10):
        est.observe(1, 0)
    assert est.conditional()[0] < 0.5  # ten recent misses outweigh thirty older hits


def test_a_batch_update_equals_one_request_at_a_time():
    """Each row evolves as if alone; rows of forgotten requests are reused from the prior."""
    rng = np.random.default_rng(0)
    prior = AcceptancePrior(mean=0.6, decay=0.9, idle_decay=0.97)
    table, alone = AcceptanceEstimates(3, prior), {i: One(3, prior) for i in range(20)}
    for _ in range(40):
        ids = sorted(rng.choice(20, size=int(rng.integers(1, 20)), replace=False).tolist())
        drafted = rng.integers(0, 4, size=len(ids))
        accepted = [int(rng.integers(0, d + 1)) for d in drafted]
        table.observe(ids, drafted, accepted)
        for i, d, a in zip(ids, drafted, accepted):
            alone[i].observe(int(d), a)
    assert np.allclose(table.cumulative(list(range(20))), [alone[i].cumulative() for i in range(20)])
    table.keep_only([3])
    assert len(table) == 1
    assert np.allclose(table.cumulative([3, 99]), [alone[3].cumulative(), [0.6, 0.36, 0.216]])
