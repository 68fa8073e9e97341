"""A step's result flush at batch B: the result queue's prepare (the loop's thread) and the pipeline's
round trip (the writer thread: redis-py packs every command, then Redis runs them), against the
embedded Redis, median us over `--flushes` steps of B deltas each.

    .venv/bin/python bench/result_flush.py --batches 1,64,128 [--flushes 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.verifier.results.flush import ResultQueue  # noqa: E402
from specd.messages import SpecStats  # noqa: E402
from specd.transport.embedded_redis import start_embedded_redis  # noqa: E402


def flush_us(client, batch: int, flushes: int) -> tuple[float, float, float]:
    """(prepare, execute, commands per flush): medians over the flushes after 50 warm-up ones."""
    result_queue = ResultQueue(client, "specd:bench:requests")
    stats = SpecStats(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=6, accepted_per_position=[3, 2, 1])
    prepares, executes, commands = [], [], []
    for step in range(flushes + 50):
        for i in range(batch):
            result_queue.delta(f"bench-{batch}-{i}", 3 * step, [5, 6, 7], stats)
        t0 = time.perf_counter()
        flush = result_queue.prepare()
        t1 = time.perf_counter()
        flush.execute()
        t2 = time.perf_counter()
        result_queue.complete(flush)
        if step >= 50:
            prepares.append((t1 - t0) * 1e6)
            executes.append((t2 - t1) * 1e6)
            commands.append(len(flush.replies))
    client.delete(*[f"specd:results:bench-{batch}-{i}" for i in range(batch)])
    return statistics.median(prepares), statistics.median(executes), statistics.median(commands)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,128")
    ap.add_argument("--flushes", type=int, default=300)
    args = ap.parse_args()
    import redis

    server = start_embedded_redis()
    try:
        client = redis.Redis.from_url(server.url)
        print("| batch | commands | prepare us | round trip us |\n|---|---|---|---|")
        for batch in (int(b) for b in args.batches.split(",")):
            prepare, execute, commands = flush_us(client, batch, args.flushes)
            print(f"| {batch} | {commands:.0f} | {prepare:.0f} | {execute:.0f} |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
