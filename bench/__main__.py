"""`python -m bench {step,e2e,all,gemm,profile} --out DIR`: the GPU fast-path benchmarks, one process.

`what` is one name or a comma list, run in the order given (all = step,e2e). `gemm`: the step's
products alone, cuBLAS vs the skinny Triton kernel (bench/gemm.py); `profile`: device time per
kernel of one static-path forward (bench/profile_step.py); `timeline`: what each kernel adds to a
graph replay's span, PDL overlaps included (bench/profile_graph.py); all three CUDA only.

    python -m bench all --out results/h200          # 8B shape on CUDA (bench/gpu_suite.sh)
    python -m bench all --small --out /tmp/bench    # toy sizes on CPU, seconds (tests/bench)

Results land in DIR as step.md / step.json and e2e.md / e2e.json (rewritten after every method,
so a run cut short keeps what it measured), and summary.md (both tables).

SIGTERM (the suite's timeout) ends the run through the normal exit path, so every stack it started
is stopped.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


WHATS = ("gemm", "gemm-sweep", "profile", "timeline", "step", "e2e")


def _parts(text: str) -> list[str]:
    parts = [p for name in text.split(",") if name for p in (("step", "e2e") if name == "all" else (name,))]
    bad = [p for p in parts if p not in WHATS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"expected {', '.join(WHATS)} or all, got {text!r}")
    return parts


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def pdl_for_e2e(rows, info: dict, q: int) -> str | None:
    """What the e2e stacks launch with, from the step bench's own run: PDL ("1") only where it was
    faster at batch 1, q = k + 1 and its outputs matched the plain launches bit for bit, else "0";
    None when the step bench timed no PDL column (CPU)."""
    row = next((r for r in rows if r.batch == 1 and r.q == q), None)
    if row is None or row.specd_no_pdl_ms is None:
        return None
    identical = all(c["pdl_vs_no_pdl_max_abs"] == 0 for c in info.get("output_checks", []))
    return "1" if identical and row.specd_graphs_ms < row.specd_no_pdl_ms else "0"


def _prepare_e2e_models(args, work: Path) -> tuple[Path, dict, int]:
    """(target, drafts by method, vocab to draw prompts from) for the chosen size."""
    from bench.e2e import DRAFT_NAMES

    if args.small:
        tiny = Path(os.environ.get("SPECD_TINY_MODELS") or work / "tiny")
        if not (tiny / "target-llama" / "config.json").exists():
            from specd.tiny_models.make import make_tiny_models

            make_tiny_models(tiny)
        return tiny / "target-llama", {m: tiny / n for m, n in DRAFT_NAMES.items()}, 500
    from bench.step import SHAPES
    from bench.synthetic import write_synthetic_llama

    target = work / "target-8b"
    if not (target / "config.json").exists():
        t0 = time.perf_counter()
        write_synthetic_llama(target, SHAPES["8b"], device="cuda")
        print(f"wrote the synthetic 8B target in {time.perf_counter() - t0:.1f} s", flush=True)
        _release_gpu_memory("writing the 8B target")

    def draft_model() -> Path:
        path = work / "draft-llama-1024"
        if not (path / "config.json").exists():
            small = dict(SHAPES["8b"], hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=128)
            write_synthetic_llama(path, small, device="cuda", seed=1)
            _release_gpu_memory("writing the draft model")
        return path

    def eagle3() -> Path:
        from specd.tiny_models.eagle3 import write_tiny_eagle3

        path = work / "draft-eagle3-8b"
        if not (path / "config.json").exists():
            write_tiny_eagle3(path, target, seed=2, init_std=0.02)  # on the CPU
        return path

    # Written only when their method's turn comes: off and replay never wait for them. A write on
    # the GPU hands the bench process's cached memory back after it: the stacks that start next
    # size their KV caches from what is free (a bench process still holding the target's write
    # once left an eagle3 stack's verifier out of memory).
    drafts = {"draft_model": draft_model, "eagle3": eagle3}
    return target, drafts, 500


def _release_gpu_memory(label: str) -> None:
    """Free what a finished bench held: runners, CUDA-graph pools and model weights sit in reference
    cycles (a graph's pool outlives its runner until a collection), and the e2e stacks that start
    next size their KV caches from the memory left free."""
    import gc

    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        print(f"after {label}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, "
              f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved by the bench process", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", type=_parts, help="step | e2e | all | gemm | profile, or a comma list")
    ap.add_argument("--out", type=Path, required=True, help="results directory")
    ap.add_argument("--small", action="store_true", help="toy sizes on CPU (the CPU test)")
    ap.add_argument("--work-dir", type=Path, default=None, help="synthetic checkpoints (default: OUT/work)")
    ap.add_argument("--step-batches", type=_ints, default=None, help="default 1,8,32,64,128 (small: 1,4)")
    ap.add_argument("--context", type=int, default=None, help="cached tokens per sequence (default 1024; small 32)")
    ap.add_argument("--timeline-gaps-ms", type=lambda t: [float(x) for x in t.split(",") if x], default=[],
                    help="timeline: also batch 1 q 4 as the engine runs it, unstaged and staged, after each "
                         "idle gap (ms, ','-separated: the drafter round trip), e.g. 0.4,2")
    ap.add_argument("--step-captures", type=int, default=None,
                    help="step: time the default graphs this many times, captured anew each time, and "
                         "report the median (default 3; small: 1)")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step (verify q = k + 1)")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="for the weight-read floor")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--e2e-batches", type=_ints, default=None, help="default 1,8,64,128 (small: 1,4)")
    ap.add_argument("--e2e-min-requests", type=int, default=None,
                    help="e2e: a round sends at least this many requests, in back-to-back waves of the batch "
                         "size, so that the replay drafter's realized acceptance is near the expected one at "
                         "small batches (bench/e2e.py waves_for; default 8, small: 1)")
    ap.add_argument("--methods", type=lambda s: s.split(","), default=None,
                    help="default off,replay,ngram,eagle3,draft_model; for A/B, a -sync suffix "
                         "(replay-sync) runs the method with drafting ahead off (SPECD_DRAFT_AHEAD=0), a -nocarry "
                         "suffix without carried drafts (SPECD_DRAFT_CARRY=0), a -carry4 suffix carrying 4 (one "
                         "step's worth at k = 3, SPECD_DRAFT_CARRY=4), an -ownread suffix (off-ownread too) with "
                         "the busy verifier's request read on its own round trip (SPECD_VERIFIER_RIDE_READS=0), "
                         "a -fixed suffix (eagle3-fixed) with adaptive draft lengths off (k drafts every step)")
    ap.add_argument("--max-tokens", type=int, default=None, help="per request (default 128; small 12)")
    ap.add_argument("--replay-acceptance", type=float, default=3.0,
                    help="replay drafter's expected acceptance length (tokens per step)")
    ap.add_argument("--device", default=None, help="default cuda when available, else cpu")
    ap.add_argument("--drafter-device", default=None, help="the e2e drafters' device (default: --device's)")
    args = ap.parse_args(argv)
    # Default SIGTERM kills at once, skipping the `finally` that stops the e2e stacks.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    args.methods = args.methods or ["off", "replay", "ngram", "eagle3", "draft_model"]
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or out / "work"
    work.mkdir(parents=True, exist_ok=True)
    sections = []
    t_start = time.perf_counter()
    if "gemm" in args.what:
        from bench.gemm import run_gemm_bench, write_gemm_results

        sections.append(write_gemm_results(run_gemm_bench(bandwidth_tbs=args.bandwidth_tbs), out))
        print(sections[-1], flush=True)
        print(f"gemm bench done at {time.perf_counter() - t_start:.0f} s", flush=True)
        _release_gpu_memory("gemm")
    if "gemm-sweep" in args.what:
        from bench.gemm_sweep import run_gemm_sweep, write_sweep

        sections.append(write_sweep(run_gemm_sweep(bandwidth_tbs=args.bandwidth_tbs), out))
        print(sections[-1], flush=True)
        print(f"gemm sweep done at {time.perf_counter() - t_start:.0f} s", flush=True)
        _release_gpu_memory("gemm sweep")
    if "profile" in args.what:
        from bench.profile_step import run_profile, write_profile

        try:  # diagnostics only: a failure here must not cost the step and e2e tables
            write_profile(run_profile(), out)
        except Exception as e:  # noqa: BLE001
            print(f"profile failed: {type(e).__name__}: {e}"[:3000], flush=True)
        print(f"profile done at {time.perf_counter() - t_start:.0f} s", flush=True)
        _release_gpu_memory("profile")
    if "timeline" in args.what:
        from bench.profile_graph import run_timeline, write_timeline

        try:  # diagnostics only, as the profile
            sections.append(write_timeline(run_timeline(gaps_ms=args.timeline_gaps_ms), out))
            print(sections[-1], flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"timeline failed: {type(e).__name__}: {e}"[:3000], flush=True)
        print(f"timeline done at {time.perf_counter() - t_start:.0f} s", flush=True)
        _release_gpu_memory("timeline")
    if "step" in args.what:
        from bench.step import run_step_bench, write_step_results

        rows, info = run_step_bench(
            shape="small" if args.small else "8b",
            batches=args.step_batches or ([1, 4] if args.small else [1, 8, 32, 64, 128]),
            qs=(1, args.k + 1), context=args.context or (32 if args.small else 1024), device=device,
            bandwidth_tbs=args.bandwidth_tbs, with_transformers=not args.no_transformers,
            warmup=1 if args.small else 3, iters=3 if args.small else 30,
            block_size=8 if args.small else 64,
            graph_captures=args.step_captures or (1 if args.small else 3))
        sections.append(write_step_results(rows, info, out))
        print(sections[-1], flush=True)
        print(f"step bench done at {time.perf_counter() - t_start:.0f} s", flush=True)
        e2e_pdl = pdl_for_e2e(rows, info, args.k + 1)
        if e2e_pdl is not None and "SPECD_PDL" not in os.environ:
            os.environ["SPECD_PDL"] = e2e_pdl  # the e2e stacks inherit it
            print(f"e2e: SPECD_PDL={e2e_pdl} (the faster of the step's PDL columns, outputs identical)", flush=True)
        del rows
        _release_gpu_memory("step")
    if "e2e" in args.what:
        from bench.e2e import run_e2e_bench, write_e2e_results

        target, drafts, vocab = _prepare_e2e_models(args, work)
        rows, info = run_e2e_bench(
            target, drafts, args.methods,
            batches=args.e2e_batches or ([1, 4] if args.small else [1, 8, 64, 128]),
            max_tokens=args.max_tokens or (12 if args.small else 128), k=args.k, device=device,
            replay_acceptance=args.replay_acceptance, work_dir=work, vocab_for_prompts=vocab,
            on_row=lambda r, i: write_e2e_results(r, i, out),
            min_requests=args.e2e_min_requests or (1 if args.small else 8), drafter_device=args.drafter_device)
        sections.append(write_e2e_results(rows, info, out))
        print(sections[-1], flush=True)
    (out / "summary.md").write_text("\n".join(sections))
    print(f"bench done in {time.perf_counter() - t_start:.0f} s; results in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
