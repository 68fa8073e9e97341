"""Where a replayed verify step's time goes, kernel by kernel, as the graph runs it (PDL included).

bench/profile_step.py launches the static path's kernels one by one and sums their device time;
under PDL a kernel starts during its predecessor's tail and waits, so inside a graph replay a
kernel's own duration no longer says what it costs. What it costs is how much later the step
ends because of it: its end minus the end of the kernel before it ("added"). Summed by kernel
kind, "added" splits the replay's span exactly. The per-layer sequence of one middle layer shows
the overlaps (start before the predecessor's end) and the gaps.

    python -m bench timeline --out results/       # CUDA only (~1 min at 8B)
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from bench.step import arch_config, random_model
from bench.step_timing import engine_like_step, repeatable_step
from specd.messages import PytorchEngineConfig
from specd.models.llama_runner import LlamaRunner

# kernel name -> kind, first match wins (Triton kernels carry their Python names)
KINDS = (("skinny_gemm", "gemm"), ("rmsnorm", "norm"), ("rope_cache", "rope"), ("partials", "attention"),
         ("combine", "attention merge"), ("silu_mul", "silu"), ("gemm|cutlass|cublas|sm90_xmma", "cublas"),
         ("index_select|indexselect", "index_select"), ("embedding|index|gather", "embedding"),
         ("cos|sin|rotary|elementwise|vectorized", "elementwise"))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for pattern, kind in KINDS if re.search(pattern, low)), "other")


def attribute(kernels: list[tuple[str, float, float]]) -> dict:
    """kernels: (name, start us, end us) of one replay. Returns the span, "added" microseconds per
    kind (end minus the previous kernel's end, by end order; they sum to the span less the first
    kernel's start offset), and the overlap/gap totals."""
    ordered = sorted(kernels, key=lambda k: k[2])
    first_start = min(k[1] for k in ordered)
    added: dict[str, float] = {}
    counts: dict[str, int] = {}
    gemm_added: list[float] = []  # each skinny GEMM's added time, in order
    prev_end, overlap, gaps = first_start, 0.0, 0.0
    for name, start, end in ordered:
        kind = kernel_kind(name)
        added[kind] = added.get(kind, 0.0) + (end - prev_end)
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "gemm":
            gemm_added.append(end - prev_end)
        if start < prev_end:
            overlap += prev_end - start
        else:
            gaps += start - prev_end
        prev_end = max(prev_end, end)
    return {"span_us": prev_end - first_start, "added_us": added, "counts": counts,
            "overlap_us": overlap, "gap_us": gaps, "products_us": per_product(gemm_added)}


PRODUCTS = ("qkv", "o_proj", "gate_up", "down_proj")  # a decoder layer's GEMMs, in launch order


def per_product(gemm_added: list[float]) -> dict[str, float]:
    """Mean added us of each layer GEMM over the layers, and the lm_head's (the last GEMM), from
    the step's GEMMs in order: 4 a layer, then the lm_head. Empty when the count does not fit."""
    if len(gemm_added) < 5 or (len(gemm_added) - 1) % len(PRODUCTS):
        return {}
    layers = gemm_added[:-1]
    out = {p: sum(layers[i::len(PRODUCTS)]) / (len(layers) // len(PRODUCTS)) for i, p in enumerate(PRODUCTS)}
    out["lm_head"] = gemm_added[-1]
    return out


def _replays(events, n: int) -> list[list[tuple[str, float, float]]]:
    """Split the recorded kernels into n equal runs of consecutive kernels (one per replay)."""
    kernels = sorted(events, key=lambda k: k[1])
    per = len(kernels) // n
    return [kernels[i * per:(i + 1) * per] for i in range(n)] if per else []


def host_profile(step, n: int = 200, top: int = 15) -> str:
    """cProfile of n steps: the host functions that take the most time of their own."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def profile_replays(runner: LlamaRunner, batch: int, q: int, context: int, repeats: int = 5,
                    python_profile: bool = False, engine_like: tuple[bool, float] | None = None) -> dict:
    """engine_like (staged, gap ms): each replay as the engine runs it (step_timing.engine_like_step),
    not back to back; no host phases then (the fill may come before the forward)."""
    steps = (repeatable_step(runner, batch, q, context) if engine_like is None else
             engine_like_step(runner, batch, q, context, staged=engine_like[0], gap_ms=engine_like[1]))
    with steps as forward:
        def step():
            forward()
            torch.cuda.synchronize()  # one replay at a time: replays never overlap in the trace

        for _ in range(50):
            step()  # capture, autotuning, and the SM clock up from idle
        walls, host = host_phases(runner, step) if engine_like is None else ([], {})
        if python_profile and engine_like is None:  # before the first torch.profiler session: CUPTI slows every CUDA call after it
            print(host_profile(step), flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                step()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
              if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start]
    events = [e for e in events if not e[0].startswith(("Memcpy", "Memset"))]
    runs = [attribute(r) for r in _replays(events, repeats) if r]
    if not runs:
        return {"batch": batch, "q": q, "error": "no kernel events recorded"}
    best = min(runs, key=lambda r: r["span_us"])
    layer = _one_layer(sorted(_replays(events, repeats)[runs.index(best)], key=lambda k: k[1]))
    wall = {"wall_us": sorted(walls)[len(walls) // 2]} if walls else {}
    return {"batch": batch, "q": q, "kernels_per_replay": sum(best["counts"].values()), **wall, "host_us": host, "spans_us": [round(r["span_us"], 1) for r in runs], **{k: v for k, v in best.items() if k != "counts"},
            "counts": best["counts"], "middle_layer": layer}


HOST_PHASES = ("bookkeeping", "fill", "to replay", "replay call", "outputs", "rest + sync")


def host_phases(runner: LlamaRunner, step, n: int = 30) -> tuple[list[float], dict[str, float]]:
    """What the step bench times, a step's wall (us, n of them), and the median of each of its host
    phases: the runner's bookkeeping before the static inputs are filled, the fill (their host
    buffer and its copy to the device), on to the graph's replay call, the call itself, the
    outputs after it (row gathers), and the rest (the bench's rollback, the wait for the device).
    Only a process's first case is clean: after a torch.profiler session, CUPTI's hooks stay and
    slow every CUDA call."""
    marks: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):  # every call's start and end, in order
            marks.setdefault(name, []).append(time.perf_counter())
            out = fn(*args, **kwargs)
            marks[name].append(time.perf_counter())
            return out
        return wrapper

    replay = torch.cuda.CUDAGraph.replay
    walls, phases = [], []
    with mock.patch.object(runner.static, "_fill", timed("fill", runner.static._fill)), \
            mock.patch.object(runner, "forward", timed("forward", runner.forward)), \
            mock.patch.object(torch.cuda.CUDAGraph, "replay", lambda g: timed("replay", replay)(g)):
        for _ in range(n):
            marks.clear()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            walls.append((t1 - t0) * 1e6)
            if "replay" in marks and "fill" in marks:
                fill, replays = marks["fill"], marks["replay"]
                cuts = [t0, fill[0], fill[1], replays[0], replays[1], marks["forward"][1], t1]
                phases.append([(b - a) * 1e6 for a, b in zip(cuts, cuts[1:])])
    host = {p: round(sorted(col)[len(col) // 2], 1) for p, col in zip(HOST_PHASES, zip(*phases))} if phases else {}
    return walls, host


def _one_layer(kernels: list[tuple[str, float, float]]) -> list[dict]:
    """The kernels of a middle layer: from the 16th norm to the next norm but one."""
    norms = [i for i, k in enumerate(kernels) if kernel_kind(k[0]) == "norm"]
    if len(norms) < 36:
        return []
    lo, hi = norms[32], norms[34]  # two norms per layer: layer 16's first norm to layer 17's
    out, prev_end = [], kernels[lo - 1][2]
    for name, start, end in kernels[lo:hi]:
        out.append({"kind": kernel_kind(name), "start_vs_prev_end_us": round(start - prev_end, 2),
                    "duration_us": round(end - start, 2), "added_us": round(end - prev_end, 2)})
        prev_end = end
    return out


def run_timeline(cases=((1, 4), (1, 1)), context: int = 1024, gaps_ms: list[float] = ()) -> list[dict]:
    """The default graphs' timeline for each (batch, q), then batch 1 q 4's as the engine runs it
    after each idle gap, unstaged and staged (engine_like_step)."""
    assert torch.cuda.is_available(), "the timeline reads CUDA kernels"
    dev = torch.device("cuda")
    config = arch_config("8b")
    model = random_model(config, torch.bfloat16, dev)
    batch_max = max(b for b, _ in cases)
    ec = PytorchEngineConfig(max_batch_size=batch_max, block_size=64,
                             num_gpu_blocks=batch_max * -(-(context + 16) // 64) + 8,
                             session_len=context + 16, device_type="cuda", dtype="bfloat16")
    runner = LlamaRunner(".", ec, model=model, config=config, use_static_path=True,
                         gemm="auto", kernels="auto", pdl="auto")
    out = []
    for batch, q in cases:
        runner.static.drop_graphs()
        result = {"env": "", **profile_replays(runner, batch, q, context, python_profile=not out)}
        runner.static.drop_graphs()
        print(json.dumps({k: v for k, v in result.items() if k != "middle_layer"}), flush=True)
        out.append(result)
    batch, q = cases[0]
    for gap in gaps_ms:
        for staged in (False, True):
            label = f"the engine's step, {'staged' if staged else 'unstaged'}, after {gap:g} ms idle"
            result = {"env": label, **profile_replays(runner, batch, q, context, engine_like=(staged, gap))}
            print(json.dumps({k: v for k, v in result.items() if k != "middle_layer"}), flush=True)
            out.append(result)
    if out:
        out[-1]["gemm_configs"] = autotuned_gemm_configs()
    return out


def autotuned_gemm_configs() -> list[str]:
    """The skinny GEMM's autotuned block shapes: "M bucket, N, K, SwiGLU, splits: config"."""
    from specd.models import skinny_gemm
    cache = getattr(getattr(skinny_gemm, "_skinny_gemm_kernel", None), "cache", {}) or {}
    return [f"{', '.join(str(v) for v in key[:5])}: BLOCK_N {c.kwargs.get('BLOCK_N')}, BLOCK_K {c.kwargs.get('BLOCK_K')}, "
            f"warps {c.num_warps}, stages {c.num_stages}" for key, c in sorted(cache.items(), key=str)]


def format_timeline(results: list[dict]) -> str:
    lines = ["where a graph replay's time goes (added = a kernel's end minus its predecessor's end; "
             "the kinds' added times sum to the span):", ""]
    for r in results:
        if "error" in r:
            lines.append(f"batch {r['batch']} q {r['q']}: {r['error']}")
            continue
        env = f" under {r['env']}" if r.get("env") else ""
        wall = f"; a step's wall (host work included) {r['wall_us']:.1f} us" if "wall_us" in r else ""
        lines += [f"batch {r['batch']}, q {r['q']}{env}: span {r['span_us']:.1f} us (replays {r['spans_us']}), "
                  f"{r['kernels_per_replay']} kernels, overlap {r['overlap_us']:.1f} us, gaps {r['gap_us']:.1f} us{wall}"]
        if r.get("host_us"):
            lines.append("host phases of a step, median us: " + ", ".join(f"{p} {us}" for p, us in r["host_us"].items()))
        if r.get("products_us"):
            lines.append("GEMM added us (layer mean): " + ", ".join(f"{p} {us:.2f}" for p, us in r["products_us"].items()))
        lines += ["", "| kind | kernels | added us | per kernel us |", "|---|---|---|---|"]
        for kind, us in sorted(r["added_us"].items(), key=lambda kv: -kv[1]):
            n = r["counts"][kind]
            lines.append(f"| {kind} | {n} | {us:.1f} | {us / n:.2f} |")
        if r["middle_layer"]:
            lines += ["", "one middle layer:", "", "| kind | start vs prev end us | duration us | added us |",
                      "|---|---|---|---|"]
            lines += [f"| {k['kind']} | {k['start_vs_prev_end_us']} | {k['duration_us']} | {k['added_us']} |"
                      for k in r["middle_layer"]]
        if r.get("gemm_configs"):
            lines += ["", "skinny GEMM block shapes (autotuned; M bucket, N, K, SwiGLU, splits):", ""]
            lines += [f"- {c}" for c in r["gemm_configs"]]
        lines.append("")
    return "\n".join(lines)


def write_timeline(results: list[dict], out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "timeline.json").write_text(json.dumps(results, indent=1))
    text = format_timeline(results)
    (out_dir / "timeline.md").write_text(text)
    return text
