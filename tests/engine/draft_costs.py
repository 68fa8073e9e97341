"""A step cost model that never measures: the default shape of specd/engine/step_cost.py, so that
adaptive draft lengths depend on acceptance alone and two runs of a test choose the same k."""

from __future__ import annotations

from specd.engine.step_cost import StepCostModel


class FixedCost(StepCostModel):
    """The default shape, never measured: drafting costs depth_share of a verify per depth; the
    verify is flat in the batch's tokens unless token_slope says otherwise (the tests' batches
    of thousands of short requests are there to draw samples, not to price them)."""

    def __init__(self, max_depth: int, *, token_slope: float = 0.0, **kwargs) -> None:
        super().__init__(max_depth, token_slope=token_slope, **kwargs)

    def observe(self, *args, **kwargs) -> None:
        pass
