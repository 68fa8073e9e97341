"""How soon the gateway's result reader delivers a new request's first entry while its XREAD blocks
on quiet streams (a long prefill, requests queued behind a full batch): cutting the read short
(CLIENT UNBLOCK, services/gateway/result_reader.py) against waiting for it, side by side in one run
on the embedded Redis, the gateway's 50 ms block.

    .venv/bin/python bench/result_join.py --requests 50
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio  # noqa: E402

from services.gateway.result_reader import ResultReader  # noqa: E402
from specd.transport.embedded_redis import start_embedded_redis  # noqa: E402
from specd.transport.redis_streams import ResultEntry, result_key  # noqa: E402


async def join_latencies(url: str, cut_reads_short: bool, requests: int, block_ms: int) -> list[float]:
    """Seconds from subscribe + the first entry's XADD to its delivery, per request, one at a time."""
    client = redis.asyncio.Redis.from_url(url)
    reader = ResultReader(client, block_ms=block_ms, cut_reads_short=cut_reads_short)
    reader.subscribe("bench-quiet")  # a stream nobody writes: every read blocks for its full time
    reader.start()
    waits = []
    try:
        await asyncio.sleep(0.1)
        for i in range(requests):
            request_id = f"bench-join-{cut_reads_short}-{i}"
            t0 = time.monotonic()
            queue = reader.subscribe(request_id)
            await client.xadd(result_key(request_id), ResultEntry(kind="final", pos=0, tokens=[1]).to_fields())
            await asyncio.wait_for(queue.get(), 10)
            waits.append(time.monotonic() - t0)
            await asyncio.sleep(0.007 * (i % 7))  # arrivals at different points of the block
    finally:
        await reader.stop()
        await client.aclose()
    return waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--block-ms", type=int, default=50, help="the reader's XREAD block (the gateway's: 50)")
    args = ap.parse_args()
    server = start_embedded_redis()
    try:
        rows = {}
        for cut in (True, False, True, False):  # each twice, interleaved
            rows.setdefault(cut, []).extend(asyncio.run(join_latencies(server.url, cut, args.requests,
                                                                       args.block_ms)))
    finally:
        server.stop()
    print(f"first entry of a new request while the reader blocks on a quiet stream ({args.block_ms} ms "
          f"block, {2 * args.requests} requests each)\n")
    print("| reader | median ms | p90 ms | max ms |\n|---|---|---|---|")
    med = {}
    for cut, name in ((True, "cuts the read short (CLIENT UNBLOCK)"), (False, "waits for the read")):
        w = sorted(x * 1e3 for x in rows[cut])
        med[cut] = statistics.median(w)
        print(f"| {name} | {med[cut]:.2f} | {w[int(0.9 * len(w))]:.2f} | {w[-1]:.2f} |")
    print(f"\nmedian, cut short / waiting: {med[True] / med[False]:.3f}x")


if __name__ == "__main__":
    main()
