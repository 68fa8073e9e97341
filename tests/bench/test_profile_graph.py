"""bench/profile_graph.py's attribution of a replay's span to kernels (the GPU trace is read on the
H200; the arithmetic and the kernel naming are checked here)."""

from __future__ import annotations

import pytest

from bench.profile_graph import attribute, format_timeline, kernel_kind


def test_added_times_split_the_span_with_overlaps_and_gaps():
    # a GEMM; a norm launched early under PDL (overlaps 2 us); a gap of 3 us; attention
    kernels = [("_skinny_gemm_kernel", 0.0, 10.0), ("_rmsnorm_kernel", 8.0, 12.5),
               ("_partials_kernel", 15.5, 20.0), ("_combine_kernel", 19.0, 21.0)]
    r = attribute(kernels)
    assert r["span_us"] == pytest.approx(21.0)
    assert sum(r["added_us"].values()) == pytest.approx(r["span_us"])
    assert r["added_us"]["gemm"] == pytest.approx(10.0) and r["added_us"]["norm"] == pytest.approx(2.5)
    assert r["added_us"]["attention"] == pytest.approx(7.5) and r["added_us"]["attention merge"] == pytest.approx(1.0)
    assert r["overlap_us"] == pytest.approx(3.0) and r["gap_us"] == pytest.approx(3.0)


def test_kernel_kinds_of_the_fused_forward():
    names = {"_skinny_gemm_kernel": "gemm", "_rmsnorm_kernel": "norm", "_rope_cache_kernel": "rope",
             "_partials_kernel": "attention", "_combine_kernel": "attention merge",
             "_silu_mul_kernel": "silu", "sm90_xmma_gemm_bf16bf16_bf16f32": "cublas",
             "void at::native::(anonymous namespace)::indexSelectLargeIndex<float>": "index_select"}
    assert {n: kernel_kind(n) for n in names} == names
    text = format_timeline([{"batch": 1, "q": 4, "span_us": 21.0, "spans_us": [21.0], "kernels_per_replay": 4,
                             "overlap_us": 3.0, "gap_us": 3.0, "added_us": {"gemm": 10.0}, "counts": {"gemm": 1},
                             "middle_layer": []}])
    assert "| gemm | 1 | 10.0 | 10.00 |" in text


def test_gemm_times_are_split_by_product_over_the_layers():
    # two layers (qkv, o, gate_up, down each), then the lm_head; a norm between them adds nothing here
    gemms = [1.0, 2.0, 5.0, 3.0, 1.5, 2.5, 6.0, 4.0, 9.0]
    kernels, t = [], 0.0
    for us in gemms:
        kernels.append(("_skinny_gemm_kernel", t, t + us))
        t += us
    r = attribute(kernels)
    assert r["products_us"] == pytest.approx({"qkv": 1.25, "o_proj": 2.25, "gate_up": 5.5, "down_proj": 3.5,
                                              "lm_head": 9.0})
    assert attribute(kernels[:-2])["products_us"] == {}  # not whole layers + lm_head: no attribution


def test_host_phases_cut_a_step_at_the_fill_the_replays_and_the_forward(monkeypatch):
    import time
    from types import SimpleNamespace

    import torch

    from bench.profile_graph import HOST_PHASES, host_phases

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: time.sleep(0.003))
    static = SimpleNamespace(_fill=lambda: time.sleep(0.002))
    runner = SimpleNamespace(static=static)

    def forward():
        time.sleep(0.001)  # bookkeeping
        runner.static._fill()
        torch.cuda.CUDAGraph.replay(object())
        time.sleep(0.004)  # outputs

    runner.forward = forward

    def step():
        runner.forward()
        time.sleep(0.005)  # rollback and the wait for the device

    walls, host = host_phases(runner, step, n=3)
    assert list(host) == list(HOST_PHASES) and len(walls) == 3
    expect = {"bookkeeping": 1e3, "fill": 2e3, "replay call": 3e3, "outputs": 4e3,
              "rest + sync": 5e3}
    for phase, us in expect.items():
        assert us <= host[phase] < us + 2e3, (phase, host)
    assert host["to replay"] < 1e3 and min(walls) >= 15e3
