"""The step cost model (specd/engine/step_cost.py): a default shape before measurements, then the
measured times, interpolated over the batch's tokens and the draft depth."""

from __future__ import annotations

import numpy as np
import pytest

from specd.engine.step_cost import CLIP, StepCostModel


def test_default_shape_is_flat_verify_and_cheap_depths():
    m = StepCostModel(4, token_slope=0.0, depth_share=0.1)
    assert m.step_seconds(np.array([1.0, 100.0]), 0) == pytest.approx([1.0, 1.0])
    assert m.step_seconds(np.array([1.0]), 3)[0] == pytest.approx(1.3)


def test_measured_points_are_interpolated():
    m = StepCostModel(4, smoothing=1.0)
    m.observe(8, 0, verify_s=0.010, draft_s=0.001, other_s=0.002)
    m.observe(64, 3, verify_s=0.020, draft_s=0.004, other_s=0.002)
    assert m.verify_seconds(np.array([8.0, 36.0, 64.0])) == pytest.approx([0.010, 0.015, 0.020])
    assert m.verify_seconds(np.array([128.0]))[0] > 0.020  # extrapolated on the last slope
    assert m.draft_seconds(0) == pytest.approx(0.001) and m.draft_seconds(3) == pytest.approx(0.004)
    assert m.draft_seconds(1) == pytest.approx(0.002)
    assert m.draft_seconds(4) == pytest.approx(0.005)
    assert m.step_seconds(np.array([8.0]), 0)[0] == pytest.approx(0.013)


def test_one_point_scales_the_default_shape():
    m = StepCostModel(2, token_slope=0.01, smoothing=1.0)
    m.observe(10, 2, verify_s=0.22, draft_s=0.02, other_s=0.0)
    assert m.verify_seconds(np.array([10.0, 110.0])) == pytest.approx([0.22, 0.22 * 2.1 / 1.1])
    assert m.draft_seconds(0) == pytest.approx(max(0.0, 0.02 - 2 * m.depth_share * 0.22 * 1.01 / 1.1))


def test_live_steps_move_the_average_and_outliers_are_clipped():
    m = StepCostModel(1, smoothing=0.5)
    m.observe(4, 1, verify_s=0.010, draft_s=0.0, other_s=0.0)
    m.observe(4, 1, verify_s=0.020, draft_s=0.0, other_s=0.0)
    assert m.verify_seconds(np.array([4.0]))[0] == pytest.approx(0.015)
    m.observe(4, 1, verify_s=100.0, draft_s=0.0, other_s=0.0)  # a graph capture, say
    assert m.verify_seconds(np.array([4.0]))[0] == pytest.approx(0.015 + 0.5 * (CLIP * 0.015 - 0.015))
    m.reset()
    assert m.num_observed == 0 and m.verify_seconds(np.array([1.0]))[0] == pytest.approx(1 + m.token_slope)
