"""The verifier's CUDA-graph capture counters: a capture stalls the loop (~0.3-0.5 s at 8B), so the
e2e bench reads how many landed in each timed round (bench/e2e.py)."""

from __future__ import annotations

from prometheus_client import generate_latest

from bench.e2e import step_split_ms
from services.verifier.metrics import VerifierMetrics


def _value(metrics: VerifierMetrics, name: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_capture_totals_become_counter_increments():
    m = VerifierMetrics()
    m.observe_captures(0, 0.0)  # the CPU runner: nothing captured, nothing counted
    assert _value(m, "specd:cuda_graph_captures_total") == 0
    m.observe_captures(3, 1.5)
    m.observe_captures(3, 1.5)  # the same totals again (a step without a capture): no change
    m.observe_captures(4, 2.25)
    assert _value(m, "specd:cuda_graph_captures_total") == 4
    assert _value(m, "specd:cuda_graph_capture_seconds_total") == 2.25


def test_the_bench_splits_captures_out_of_the_phases():
    before = {"verify": (1.0, 10.0), "rest": (0.5, 10.0), "captures": (1.0, 2.0)}
    after = {"verify": (2.0, 20.0), "rest": (0.7, 20.0), "captures": (1.6, 3.0)}
    split = step_split_ms(before, after)
    assert split == {"verify": 100.0, "rest": 20.0, "steps": 10, "captures": 1, "capture_s": 0.6}
