"""Redis commands per generated token, through the whole stack (issue 48's measure of the Redis tier).

    .venv/bin/python bench/redis_commands.py --requests 64 --concurrency 32 --max-tokens 128

Starts `serve api_server`'s stack on the trained family (EAGLE-3) with its embedded Redis, sends
greedy completions through the OpenAI client, `concurrency` at a time, and reads Redis's own
command counters (INFO commandstats) before and after: commands per generated token, in all and by
command, largest first. Scripts count as EVALSHA plus the commands they run.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def command_counts(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=str(ROOT / "models"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()

    import openai

    from services.launcher.supervisor import Stack, StackConfig
    from specd.transport.embedded_redis import start_embedded_redis
    from specd.transport.ports import free_port

    models = Path(args.models)
    server = start_embedded_redis()
    stack = Stack(StackConfig(model=str(models / "specd-py-target"), server_name="127.0.0.1", server_port=free_port(),
                              grpc_port=free_port(), redis_url=server.url, speculative_algorithm="eagle3",
                              speculative_draft_model=str(models / "specd-py-eagle3"), speculative_num_draft_tokens=3,
                              max_batch_size=args.concurrency, log_level="warning"))
    try:
        stack.start(timeout=300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.server_port}/v1", api_key="x",
                               max_retries=0, timeout=300)
        name = client.models.list().data[0].id

        def one(i: int) -> int:
            reply = client.completions.create(model=name, prompt=f"def function_{i}(value):\n    ", temperature=0,
                                              max_tokens=args.max_tokens, extra_body={"ignore_eos": True})
            return reply.usage.completion_tokens

        one(0)  # warm: graphs, compiles, first connections
        rc = redis.Redis.from_url(server.url)
        before = command_counts(rc)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            tokens = sum(pool.map(one, range(args.requests)))
        seconds = time.perf_counter() - t0
        after = command_counts(rc)
    finally:
        stack.stop()
        server.stop()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    delta = {k: v for k, v in delta.items() if v > 0 and k not in ("info",)}
    total = sum(delta.values())
    print(f"{args.requests} greedy completions of {args.max_tokens} tokens, {args.concurrency} at a time: "
          f"{tokens} tokens in {seconds:.1f} s; {total} Redis commands, {total / tokens:.3f} a token")
    for command, calls in sorted(delta.items(), key=lambda kv: -kv[1]):
        print(f"  {command:<14} {calls:>7}  {calls / tokens:.3f} a token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
