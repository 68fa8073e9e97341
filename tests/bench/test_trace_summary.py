"""bench/trace_summary.py over events in Kineto's Chrome-trace layout (what torch.profiler writes
for a CUDA graph replay: the cudaGraphLaunch runtime call and its kernels share a correlation id)."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.trace_summary import graph_launches, kernel_differences, load_events, main, summary_table


def _rt(name, ts, dur, corr, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": tid,
            "args": {"correlation": corr}}


def _k(name, ts, dur, corr, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}


def _step(t0, corr, gemm_us):
    """The launch mark at t0, the graph launched 3 us after it, its copy and two kernels with an
    idle 5 us between them."""
    return [_rt("cudaEventRecord", t0, 2, corr - 1),
            _rt("cudaGraphLaunch", t0 + 5, 20, corr),
            _k("Memcpy HtoD (Pinned -> Device)", t0 + 10, 2, corr, "gpu_memcpy"),
            _k("gemm", t0 + 12, gemm_us, corr),
            _k("norm", t0 + 12 + gemm_us + 5, 3, corr)]


def test_each_launch_is_measured_from_its_mark_and_its_device_work():
    events = _step(0, 10, 100) + _step(1000, 20, 100) + [_rt("cudaLaunchKernel", 200, 4, 30),
                                                          _k("other", 50, 10, 30)]
    launches = graph_launches(events)
    assert len(launches) == 2
    g = launches[0]
    assert (g.host_gap, g.call, g.delay, g.span, g.busy, g.idle) == (3, 20, 5, 110, 105, 5)
    assert g.num_ops == 3 and g.overlapping == 1 and launches[1].overlapping == 0
    assert g.durations == {"Memcpy HtoD (Pinned -> Device)": 2, "gemm": 100, "norm": 3}
    table = summary_table(launches)
    assert "| 3 | 2 | 3.0 | 20.0 | 5.0 | 110.0 | 105.0 | 5.0 | 1 |" in table


def test_launches_are_found_by_their_device_work_alone():
    """Without runtime calls in the trace the graphs are still there (their ops share an id),
    their host-side fields unknown; runtime calls without device work count for nothing, and
    neither does a kernel launched alone."""
    events = _step(0, 10, 100) + [_k("alone", 500, 4, 11)]
    runtime_only = [e for e in events if e["cat"] == "cuda_runtime"]
    assert graph_launches(runtime_only) == []
    (g,) = graph_launches([e for e in events if e["cat"] != "cuda_runtime"])
    assert (g.host_gap, g.delay, g.span, g.num_ops) == (None, None, 110, 3)
    assert "| 3 | 1 | - | - | - | 110.0 | 105.0 | 5.0 | 0 |" in summary_table([g])


def test_two_traces_compare_kernel_by_kernel(tmp_path, capsys):
    a, b = _step(0, 10, 100), _step(0, 10, 130)
    diff = kernel_differences(graph_launches(a), graph_launches(b))
    assert "b - a = 30.0 us" in diff and "| gemm | 100.0 | 130.0 | +30.0 |" in diff
    paths = []
    for name, events in (("a", a), ("b", b)):
        path = tmp_path / f"{name}.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": events}, f)
        paths.append(str(path))
    assert load_events(paths[0]) == a
    main(paths)
    out = capsys.readouterr().out
    assert "1 graph launches" in out and "+30.0" in out
    with pytest.raises(SystemExit):
        main(paths + paths[:1])
