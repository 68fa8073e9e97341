"""kernels/l2_prefetch.py: plans are validated on construction, parsed from the environment's
spelling, scoped like the other launch settings, and never apply off the GPU (the CPU twin)."""

from __future__ import annotations

import pytest
import torch

from specd.models.kernels import l2_prefetch
from specd.models.kernels.l2_prefetch import PrefetchPlan, l2_prefetch_scope, resolve_plan, target_for


def test_plans_parse_and_describe_round_trip():
    plan = PrefetchPlan.parse("o=32, gate_up=8,kind=sector")
    assert plan.megabytes == {"o": 32.0, "gate_up": 8.0} and plan.kind == "sector" and plan.enabled
    assert PrefetchPlan.parse(plan.describe()) == plan
    for off in ("off", "", "0", "o=0"):
        assert not PrefetchPlan.parse(off).enabled
    assert PrefetchPlan.parse("o=0").describe() == "off"


@pytest.mark.parametrize("spec, message", [("attn=4", "unknown products"), ("o=-1", ">= 0"), ("o=x", "number of MB"),
                                           ("o", "name=value"), ("o=4,kind=tma", "kind must be")])
def test_bad_plans_are_refused_with_the_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        PrefetchPlan.parse(spec)


def test_the_environment_names_the_default_and_scopes_nest(monkeypatch):
    monkeypatch.delenv(l2_prefetch.L2_PREFETCH_ENV, raising=False)
    assert not resolve_plan(None).enabled
    monkeypatch.setenv(l2_prefetch.L2_PREFETCH_ENV, "o=16")
    assert resolve_plan(None).megabytes == {"o": 16.0}
    assert resolve_plan("qkv=4").megabytes == {"qkv": 4.0}
    outer, inner = PrefetchPlan.parse("o=1"), PrefetchPlan.parse("down=2")
    with l2_prefetch_scope(outer):
        with l2_prefetch_scope(inner):
            assert l2_prefetch.active_plan() is inner
        assert l2_prefetch.active_plan() is outer
    assert not l2_prefetch.active_plan().enabled


def test_nothing_is_prefetched_off_the_gpu():
    """On CPU (and in the interpreter) there are no prefetch instructions: no target, so the fused
    forward passes the skinny GEMM no prefetch arguments and computes exactly what it did."""
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert target_for("o", weight, PrefetchPlan.parse("o=32")) is None
    assert target_for("o", None, PrefetchPlan.parse("o=32")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the prefetch units are sized on the device")
def test_targets_cover_the_planned_bytes_and_both_gate_up_halves():
    weight = torch.zeros(1024, 1024, dtype=torch.bfloat16, device="cuda")  # 2 MB
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("sm_90 and later")
    t = target_for("o", weight, PrefetchPlan.parse("o=1,kind=line"))
    assert (t.units, t.regions, t.unit_elems) == (2 ** 20 // 128, 1, 64)
    gu = target_for("gate_up", weight, PrefetchPlan.parse("gate_up=64,kind=bulk"))  # more than the weight: all of it
    assert gu.regions == 2 and gu.units * gu.unit_elems * 2 == weight.numel() and gu.region_stride == weight.numel() // 2
