"""Engine tests run with adaptive draft lengths on, their step costs frozen at the default shape
(draft_costs.FixedCost): measured CPU timings would make the chosen k, hence sampled tokens and
speculation counts, vary between the two engines an A/B test compares. Tests marked
`measured_draft_costs` get the measured model."""

from __future__ import annotations

import pytest

from specd.engine import draft_policy
from tests.engine.draft_costs import FixedCost


@pytest.fixture(autouse=True)
def _fixed_draft_costs(request, monkeypatch):
    if request.node.get_closest_marker("measured_draft_costs") is None:
        monkeypatch.setattr(draft_policy, "StepCostModel", FixedCost)
