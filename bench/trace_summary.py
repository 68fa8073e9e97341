"""What a verifier's step trace (specd/step_trace.py) says about its graph replays.

    python -m bench.trace_summary A/trace.json.gz [B/trace.json.gz]

Per CUDA-graph launch (the device work of one correlation id, and the `cudaGraphLaunch` runtime
call of that id where the trace holds it): the host's gap from the launch mark (the `cudaEventRecord` right before it on the
same thread) to the launch call, the call's own host time, the device's delay from the call to the graph's first work, the
graph's span on the device, the time inside that span when none of its work ran (idle), and device
work of other launches overlapping it. Launches are grouped by how many device ops their graph
has (the q = 4 verify graph, the q = 1 decode graph ... differ). With two traces, the kernels
whose mean duration differs most between them, per group present in both.

Why: the device's clock says how long a forward took, not why: a late start shows here as delay or
host gap, a device held up inside the graph as idle, the same kernels running slower as busy time,
kernel by kernel, and another graph as another op count (graphs captured without the runner's
kernel settings had 360 ops where the right ones had 263).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import mean, median

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class GraphLaunch:
    """One graph replay, in microseconds on the trace's clock (host and device aligned by it)."""

    host_ts: float | None  # the cudaGraphLaunch call's start
    host_gap: float | None  # from the preceding cudaEventRecord's end (the launch mark) to the call
    delay: float | None  # from the call's start to the graph's first device work
    call: float | None  # the cudaGraphLaunch call's own host time
    span: float  # first device work's start to the last's end
    busy: float  # the union of the graph's device work within the span
    num_ops: int
    overlapping: int  # other launches' device ops overlapping the span
    durations: dict[str, float] = field(default_factory=dict)  # kernel name -> total us in this launch
    device_ts: float = 0.0  # the graph's first device work

    @property
    def idle(self) -> float:
        return self.span - self.busy


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def graph_launches(events: list[dict], min_ops: int = 2) -> list[GraphLaunch]:
    """Every graph launch of the trace, in device order: the device work of one correlation id
    with at least min_ops ops (a kernel launched alone has one). The launch call's fields (host
    gap, delay) are None where the trace holds no runtime call of that id."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    by_corr: dict = defaultdict(list)
    for e in device:
        by_corr[e.get("args", {}).get("correlation")].append(e)
    calls, gaps, last_mark = {}, {}, {}  # correlation -> its runtime call / gap from the mark; tid -> mark's end
    for call in sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")),
                       key=lambda e: e["ts"]):
        if call["name"].startswith("cudaEventRecord"):
            last_mark[call.get("tid")] = call["ts"] + call["dur"]
        elif call["name"].startswith("cudaGraphLaunch"):
            corr = call.get("args", {}).get("correlation")
            calls[corr] = call
            mark = last_mark.pop(call.get("tid"), None)
            gaps[corr] = None if mark is None else call["ts"] - mark
    spans = [(e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("correlation")) for e in device]
    out = []
    for corr, ops in by_corr.items():
        if corr is None or len(ops) < min_ops:
            continue
        first = min(e["ts"] for e in ops)
        last = max(e["ts"] + e["dur"] for e in ops)
        durations: dict[str, float] = defaultdict(float)
        for e in ops:
            durations[e["name"]] += e["dur"]
        call = calls.get(corr)
        out.append(GraphLaunch(
            host_ts=None if call is None else call["ts"], host_gap=gaps.get(corr),
            delay=None if call is None else first - call["ts"], call=None if call is None else call["dur"],
            span=last - first,
            busy=_union_length([(e["ts"], e["ts"] + e["dur"]) for e in ops]), num_ops=len(ops),
            overlapping=sum(1 for s, t, c in spans if c != corr and s < last and t > first),
            durations=dict(durations), device_ts=first))
    return sorted(out, key=lambda g: g.device_ts)


def group_by_shape(launches: list[GraphLaunch]) -> dict[int, list[GraphLaunch]]:
    groups: dict[int, list[GraphLaunch]] = defaultdict(list)
    for g in launches:
        groups[g.num_ops].append(g)
    return dict(groups)


def _median_or_dash(values: list[float]) -> str:
    return f"{median(values):.1f}" if values else "-"


def summary_table(launches: list[GraphLaunch]) -> str:
    """One row per graph shape: launches and the medians of what GraphLaunch holds (us)."""
    lines = ["| device ops | launches | host gap from mark | launch call | delay to device | span | busy | idle | "
             "overlapping ops |", "|---|---|---|---|---|---|---|---|---|"]
    for num_ops, gs in sorted(group_by_shape(launches).items(), key=lambda kv: -len(kv[1])):
        gaps = [g.host_gap for g in gs if g.host_gap is not None]
        delays = [g.delay for g in gs if g.delay is not None]
        calls = [g.call for g in gs if g.call is not None]
        lines.append(f"| {num_ops} | {len(gs)} | {_median_or_dash(gaps)} | {_median_or_dash(calls)} | "
                     f"{_median_or_dash(delays)} | "
                     f"{median(g.span for g in gs):.1f} | "
                     f"{median(g.busy for g in gs):.1f} | {median(g.idle for g in gs):.1f} | "
                     f"{sum(g.overlapping for g in gs)} |")
    return "\n".join(lines) + "\n"


def kernel_differences(a: list[GraphLaunch], b: list[GraphLaunch], top: int = 12) -> str:
    """Per graph shape in both: the kernels whose mean us per launch differ most, b - a."""
    ga, gb = group_by_shape(a), group_by_shape(b)
    lines = []
    for num_ops in sorted(set(ga) & set(gb)):
        names = set().union(*(g.durations for g in ga[num_ops] + gb[num_ops]))
        diffs = []
        for name in names:
            ma = mean(g.durations.get(name, 0.0) for g in ga[num_ops])
            mb = mean(g.durations.get(name, 0.0) for g in gb[num_ops])
            diffs.append((mb - ma, ma, mb, name))
        diffs.sort(key=lambda d: -abs(d[0]))
        total = sum(d[0] for d in diffs)
        lines += [f"graph of {num_ops} device ops ({len(ga[num_ops])} / {len(gb[num_ops])} launches): "
                  f"kernel time per launch b - a = {total:.1f} us", "",
                  "| kernel | a us | b us | b - a |", "|---|---|---|---|"]
        lines += [f"| {name[:90]} | {ma:.1f} | {mb:.1f} | {d:+.1f} |" for d, ma, mb, name in diffs[:top]]
        lines.append("")
    return "\n".join(lines)


def step_ranges_table(events: list[dict], prefix: str = "drafter step") -> str:
    """The traced steps' named ranges (record_function, e.g. services/drafter/servicer.py's: the
    step's inputs and propose, the propose inside, the answer): how many, mean ms; then the
    device's busy ms (the union of its work) per step of the first range."""
    ranges: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith(prefix):
            ranges[e["name"]].append(e.get("dur", 0.0))
    if not ranges:
        return f"no '{prefix}' ranges in the trace"
    lines = ["| range | count | mean ms |", "|---|---|---|"]
    lines += [f"| {name} | {len(d)} | {mean(d) / 1e3:.2f} |" for name, d in ranges.items()]
    device = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events if e.get("cat") in DEVICE_CATS]
    steps = len(next(iter(ranges.values())))
    lines.append(f"\ndevice busy {_union_length(device) / 1e3 / steps:.2f} ms a step ({steps} steps)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="one or two trace.json(.gz) files")
    args = ap.parse_args(argv)
    if len(args.traces) > 2:
        ap.error("at most two traces")
    launches = [graph_launches(load_events(p)) for p in args.traces]
    for path, ls in zip(args.traces, launches):
        print(f"{path}: {len(ls)} graph launches\n\n{summary_table(ls)}")
    if len(launches) == 2:
        print(kernel_differences(*launches))


if __name__ == "__main__":
    main()
