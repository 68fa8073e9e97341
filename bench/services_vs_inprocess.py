"""Tokens/s through the services (gateway -> Redis -> verifier <-> drafter) versus the in-process
pipeline, on the same model, prompts and speculative method, side by side in one run, and where
the difference goes (drafter RPC, Redis, queueing).

    .venv/bin/python bench/services_vs_inprocess.py --method eagle3 --num-prompts 32 --max-tokens 64

--no-async-emit runs the verifier with its result writes on the loop's thread (each step waits for
its Redis round trip) instead of on the writer thread that overlaps them with the next step.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.launcher.supervisor import Stack, StackConfig  # noqa: E402
from specd.engine.builder import build_engine  # noqa: E402
from specd.messages import PytorchEngineConfig, SpeculativeConfig  # noqa: E402
from specd.sampling_params import SamplingParams  # noqa: E402
from specd.transport.ports import free_port  # noqa: E402

DRAFTS = {"eagle3": "draft-eagle3", "draft_model": "draft-llama-small"}
TARGETS = {"deepseek_mtp": "target-deepseek-mtp", "qwen3_5_mtp": "target-qwen3_5-mtp"}


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(rng.randint(8, 48))] for _ in range(n)]


def run_in_process(target, spec, prompts, max_tokens, batch):
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=batch), spec)
    params = [SamplingParams(max_new_tokens=max_tokens, ignore_eos=True) for _ in prompts]
    engine.generate(prompts[:2], params[:2])  # warm-up
    t0 = time.perf_counter()
    timings_before = dict(vars(engine.stats.timings))
    steps_before = engine.stats.num_steps
    seqs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    timings = {k: v - timings_before[k] for k, v in vars(engine.stats.timings).items()}
    tokens = sum(s.num_output_tokens for s in seqs)
    return {"elapsed": elapsed, "tokens": tokens, "steps": engine.stats.num_steps - steps_before, **timings}


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*{re.escape(labels)}[^}}]*}})? ([0-9.e+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def phase_seconds(text: str) -> dict[str, float]:
    out = {p: metric(text, "specd:step_duration_seconds_sum", f'phase="{p}"') for p in ("draft", "verify", "other")}
    out["emit"] = metric(text, "specd:emit_duration_seconds_sum")
    out["emit_wait"] = metric(text, "specd:emit_wait_duration_seconds_sum")
    out["flush"] = metric(text, "specd:result_flush_duration_seconds_sum")
    out["steps"] = metric(text, "specd:step_duration_seconds_count", 'phase="verify"')
    return out


def run_services(target, method, draft, k, prompts, max_tokens, batch, async_emit=True):
    import openai

    metrics_port = free_port()
    config = StackConfig(model=str(target), server_name="127.0.0.1", server_port=free_port(), grpc_port=free_port(),
                         speculative_algorithm=method, speculative_draft_model=str(draft) if draft else None,
                         speculative_num_draft_tokens=k, max_batch_size=batch, enable_metrics=True,
                         verifier_metrics_port=metrics_port, log_level="warning",
                         extra_env={"SPECD_ASYNC_EMIT": "1" if async_emit else "0"})  # read by `specd verifier`
    stack = Stack(config)
    stack.start(timeout=300)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{config.server_port}/v1", api_key="x", max_retries=0,
                               timeout=600)
        model = client.models.list().data[0].id

        def one(prompt):
            return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True})

        one(prompts[0])  # warm-up
        before = phase_seconds(scrape(f"http://127.0.0.1:{metrics_port}/metrics"))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(one, prompts))
        elapsed = time.perf_counter() - t0
        after = phase_seconds(scrape(f"http://127.0.0.1:{metrics_port}/metrics"))
        tokens = sum(r.usage.completion_tokens for r in replies)
        return {"elapsed": elapsed, "tokens": tokens, **{k: after[k] - before[k] for k in after}}
    finally:
        stack.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, default=ROOT / ".tiny-models")
    ap.add_argument("--method", default="eagle3", choices=["eagle3", "deepseek_mtp", "qwen3_5_mtp", "draft_model",
                                                           "ngram", "off"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--async-emit", action=argparse.BooleanOptionalAction, default=True,
                    help="the verifier's result writes overlap the next step (default; --no-async-emit: not)")
    args = ap.parse_args()
    if not (args.models / "target-llama" / "config.json").exists():
        from specd.tiny_models.make import make_tiny_models

        make_tiny_models(args.models)
    method = None if args.method == "off" else args.method
    target = args.models / TARGETS.get(args.method, "target-llama")
    draft = args.models / DRAFTS[args.method] if args.method in DRAFTS else None
    spec = SpeculativeConfig(method=method, num_speculative_tokens=args.k, model=str(draft or "")) if method else None
    prompts = make_prompts(args.num_prompts)
    batch = args.num_prompts

    local = run_in_process(target, spec, prompts, args.max_tokens, batch)
    remote = run_services(target, method, draft, args.k, prompts, args.max_tokens, batch, args.async_emit)
    local_tps, remote_tps = local["tokens"] / local["elapsed"], remote["tokens"] / remote["elapsed"]
    print(f"method={args.method} k={args.k} prompts={args.num_prompts} max_tokens={args.max_tokens} "
          f"batch={batch} async_emit={'on' if args.async_emit else 'off'} (greedy, ignore_eos)")
    print(f"{'':28}{'in-process':>12}{'services':>12}")
    print(f"{'output tokens':28}{local['tokens']:>12}{remote['tokens']:>12}")
    print(f"{'wall seconds':28}{local['elapsed']:>12.2f}{remote['elapsed']:>12.2f}")
    print(f"{'tokens/s':28}{local_tps:>12.1f}{remote_tps:>12.1f}")
    print(f"{'engine steps':28}{local['steps']:>12}{remote['steps']:>12.0f}")
    print(f"{'draft s (services: + gRPC)':28}{local['draft']:>12.2f}{remote['draft']:>12.2f}")
    print(f"{'verify s':28}{local['verify']:>12.2f}{remote['verify']:>12.2f}")
    # The verifier's "other" phase is the rest of its loop: admission (XREADGROUP), commit, Redis writes.
    print(f"{'other s (admit, commit, IO)':28}{local['admit'] + local['commit']:>12.2f}{remote['other']:>12.2f}")
    # Redis writes on the loop's path: queueing, and blocked on flushes (the whole round trip when
    # synchronous; only waiting for the writer thread when async). The writer's round trips are
    # the Redis time itself, overlapped with engine steps when async.
    print(f"{'  of which Redis writes s':28}{0.0:>12.2f}{remote['emit']:>12.2f}")
    print(f"{'    blocked on flushes s':28}{0.0:>12.2f}{remote['emit_wait']:>12.2f}")
    print(f"{'result round trips s':28}{0.0:>12.2f}{remote['flush']:>12.2f}")
    accounted = remote["draft"] + remote["verify"] + remote["other"]
    print(f"{'services: idle/queue/HTTP s':28}{'':>12}{remote['elapsed'] - accounted:>12.2f}")
    print(f"ratio services / in-process tokens/s: {remote_tps / local_tps:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
