"""Co-located services on one host's CPUs: two verifiers, two drafters and two grammar replicas
(plus Redis and a gateway) serving one burst of requests, timed under several thread settings.

Why: every service is its own process, and each sizes its torch / OpenMP threads. Left to
torch's default (one thread per core, in every process) six processes on two cores oversubscribe
them several times over and spin against each other; `specd/host_threads.py` sizes each service
to its share instead. This bench compares the default against hand-set thread counts on the same
workload, side by side in one run, and `--max-ratio` makes it fail when the default is more than
that much slower than the best hand-set one (tests/bench/test_colocated.py runs it so).

    .venv/bin/python -m bench.colocated --requests 48 --max-tokens 32
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.launcher.supervisor import Stack, StackConfig  # noqa: E402
from specd.transport.ports import free_port  # noqa: E402

MODELS = ROOT / "models"
# Each variant: the environment every service starts with. "default" sets nothing (what users get);
# the others pin every process's threads by hand, as an operator would.
VARIANTS = {
    "default": {},
    "omp1": {"OMP_NUM_THREADS": "1"},
    "omp2": {"OMP_NUM_THREADS": "2"},
}


class ColocatedStack(Stack):
    """Stack's processes, but `replicas` drafters, grammar services and verifiers on this host."""

    def __init__(self, config: StackConfig, replicas: int) -> None:
        super().__init__(config)
        self.replicas = replicas

    def start(self, timeout: float = 300.0) -> None:
        from specd.transport.embedded_redis import start_embedded_redis

        c = self.config
        self.redis = start_embedded_redis()
        self.redis_url = self.redis.url
        drafters = [f"127.0.0.1:{free_port()}" for _ in range(self.replicas)]
        grammars = [f"127.0.0.1:{free_port()}" for _ in range(self.replicas)]
        for address in drafters:
            self._spawn("drafter", ["drafter", c.model, "--speculative-algorithm", c.speculative_algorithm,
                                    "--speculative-draft-model", c.speculative_draft_model,
                                    "--host", "127.0.0.1", "--port", address.split(":")[1]])
        for address in grammars:
            self._spawn("grammar", ["grammar", c.model, "--host", "127.0.0.1", "--port", address.split(":")[1]])
        for address in drafters + grammars:
            self._wait_grpc_health(address, timeout)
        for i in range(self.replicas):
            admin = free_port()
            self._spawn("verifier", ["verifier", c.model, "--redis-url", self.redis_url, "--admin-port", str(admin),
                                     "--metrics-port", "0", "--consumer", f"colocated-{i}",
                                     "--drafter", ",".join(drafters), "--grammar", ",".join(grammars),
                                     "--speculative-algorithm", c.speculative_algorithm,
                                     "--speculative-num-draft-tokens", str(c.speculative_num_draft_tokens)])
            self._wait_grpc_health(f"127.0.0.1:{admin}", timeout)
        self._spawn("gateway", ["gateway", c.model, "--host", "127.0.0.1", "--port", str(c.server_port),
                                "--grpc-port", str(self.grpc_port), "--redis-url", self.redis_url,
                                "--grammar", grammars[0]])
        self._wait_http_health(f"http://127.0.0.1:{c.server_port}/health", timeout)


def burst(port: int, requests: int, max_tokens: int) -> tuple[float, int]:
    """Seconds to answer `requests` concurrent completions, and the tokens they returned."""
    import httpx

    prompts = [f"def function_{i}(value):\n    " for i in range(requests)]

    def one(prompt: str) -> int:
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=600.0,
                           json={"model": str(MODELS / "specd-py-target"), "prompt": prompt,
                                 "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        tokens = sum(pool.map(one, prompts))
    return time.perf_counter() - start, tokens


def run_variant(name: str, replicas: int, requests: int, max_tokens: int, rounds: int) -> list[float]:
    port = free_port()
    config = StackConfig(model=str(MODELS / "specd-py-target"), server_port=port, grpc_port=free_port(),
                         speculative_algorithm="eagle3",
                         speculative_draft_model=str(MODELS / "specd-py-eagle3"),
                         log_level="warning", extra_env=VARIANTS[name])
    # The variant's environment must not inherit the caller's own thread settings.
    saved = {k: os.environ.pop(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}
    stack = ColocatedStack(config, replicas)
    try:
        stack.start()
        burst(port, min(requests, 4), 4)  # warm-up: first forwards, compiled grammars
        seconds = []
        for _ in range(rounds):
            elapsed, tokens = burst(port, requests, max_tokens)
            if tokens != requests * max_tokens:
                raise RuntimeError(f"{name}: {tokens} tokens, expected {requests * max_tokens}")
            seconds.append(elapsed)
        return seconds
    finally:
        stack.stop()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="drafters, grammar services and verifiers each")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--max-ratio", type=float, default=0.0,
                   help="exit 1 when the default's best round is more than this times the best hand-set one's")
    args = p.parse_args(argv)
    names = args.variants.split(",")
    results = {name: run_variant(name, args.replicas, args.requests, args.max_tokens, args.rounds) for name in names}
    print(f"\n{os.cpu_count()} cores; {args.replicas} verifiers, drafters and grammar services; "
          f"{args.requests} requests x {args.max_tokens} tokens, eagle3 k = 3, greedy\n")
    print("| threads | seconds (rounds) | vs the best |")
    print("|---|---|---|")
    best = min(min(s) for s in results.values())
    for name, seconds in results.items():
        print(f"| {name} | {min(seconds):.2f} ({', '.join(f'{s:.2f}' for s in seconds)}) | {min(seconds) / best:.2f}x |")
    if args.max_ratio and "default" in results:
        hand_set = [min(s) for n, s in results.items() if n != "default"]
        ratio = min(results["default"]) / min(hand_set) if hand_set else 1.0
        print(f"\ndefault / best hand-set: {ratio:.2f}x (bar {args.max_ratio}x)")
        return 0 if ratio <= args.max_ratio else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
