"""Time to first token through the services (gRPC GenerateStream -> gateway -> Redis -> verifier
<-> drafter), the verifier's early first-token flush on and off, side by side in one run.

With it on (the default), the first tokens of the requests a step prefills leave on a result
flush of their own before that step drafts and verifies (services/verifier/worker.py
emit_first_tokens); off (SPECD_VERIFIER_EARLY_FIRST_TOKEN=0), they left with the step's results,
one draft + verify later. Each request streams alone (`--background N`: while N others stream
without pause), so the figure is a request's own latency, not a queue's.

    .venv/bin/python bench/first_token.py --method eagle3 --requests 40 --background 0,4 [--late-first]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.launcher.supervisor import Stack, StackConfig  # noqa: E402
from specd.transport.ports import free_port  # noqa: E402

MODELS = ROOT / "models"
DRAFTS = {"eagle3": "specd-py-eagle3", "deepseek_mtp": "specd-py-mtp", "draft_model": "specd-py-draft"}
VARIANTS = {"early": {"SPECD_VERIFIER_EARLY_FIRST_TOKEN": "1"}, "late": {"SPECD_VERIFIER_EARLY_FIRST_TOKEN": "0"}}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, 8000) for _ in range(rng.randint(16, 64))] for _ in range(n)]


def stream_once(stub, pb, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first streamed tokens, seconds to the end, tokens) of one request."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first, tokens = None, 0
    for delta in stub.GenerateStream(request, timeout=120):
        if delta.token_ids and first is None:
            first = time.perf_counter() - t0
        tokens += len(delta.token_ids)
    return first, time.perf_counter() - t0, tokens


def measure(stack: Stack, requests: list[list[int]], max_tokens: int, background: int) -> dict:
    import grpc

    from specd.v1 import generate_pb2 as pb
    from specd.v1 import generate_pb2_grpc

    stop = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)

        def keep_streaming(seed: int) -> None:  # the load the measured requests meet
            for prompt in prompts(10_000, seed):
                if stop.is_set():
                    return
                stream_once(stub, pb, prompt, max_tokens)

        for prompt in requests[:3]:
            stream_once(stub, pb, prompt, max_tokens)  # warm-up (graph-free on CPU: caches, threads)
        threads = [threading.Thread(target=keep_streaming, args=(100 + i,), daemon=True) for i in range(background)]
        for t in threads:
            t.start()
        time.sleep(0.5 if background else 0.0)
        ttft, total, tokens = [], [], 0
        for prompt in requests[3:]:
            first, end, n = stream_once(stub, pb, prompt, max_tokens)
            ttft.append(first * 1e3)
            total.append(end * 1e3)
            tokens += n
        stop.set()
        for t in threads:
            t.join(timeout=60)
    return {"ttft_ms": statistics.median(ttft), "ttft_p90_ms": sorted(ttft)[int(0.9 * (len(ttft) - 1))],
            "latency_ms": statistics.median(total), "requests": len(ttft), "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="eagle3", choices=["off", "ngram", *DRAFTS])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--background", default="0,4", help="concurrent streams meeting the measured ones")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--late-first", action="store_true", help="start the stack without it first (order check)")
    args = ap.parse_args(argv)
    loads = [int(b) for b in args.background.split(",")]
    requests = prompts(args.requests + 3, args.seed)
    rows = []
    for name, env in (reversed(VARIANTS.items()) if args.late_first else VARIANTS.items()):
        spec = None if args.method == "off" else args.method
        draft = str(MODELS / DRAFTS[args.method]) if args.method in DRAFTS else None
        stack = Stack(StackConfig(model=str(MODELS / "specd-py-target"), server_name="127.0.0.1",
                                  server_port=free_port(), grpc_port=free_port(), speculative_algorithm=spec,
                                  speculative_draft_model=draft, max_batch_size=16, log_level="warning",
                                  extra_env=env))
        try:
            stack.start(timeout=300)
            for background in loads:
                row = measure(stack, requests, args.max_tokens, background) | {"variant": name, "background": background}
                print(row, flush=True)
                rows.append(row)
        finally:
            stack.stop()
    print(f"\nmethod {args.method}, {args.requests} requests of {args.max_tokens} tokens each, one at a time "
          "(with N other streams running)")
    print("| background streams | TTFT ms early (p90) | TTFT ms late (p90) | early / late | latency ms early | latency ms late |")
    print("|---|---|---|---|---|---|")
    for background in loads:
        e, lt = (next(r for r in rows if r["variant"] == v and r["background"] == background) for v in ("early", "late"))
        print(f"| {background} | {e['ttft_ms']:.1f} ({e['ttft_p90_ms']:.1f}) | {lt['ttft_ms']:.1f} ({lt['ttft_p90_ms']:.1f}) "
              f"| {e['ttft_ms'] / lt['ttft_ms']:.2f}x | {e['latency_ms']:.1f} | {lt['latency_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
