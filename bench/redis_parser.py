"""redis-py's reply parser, its pure-Python one against hiredis (C), side by side in one run on the
embedded Redis, where the services parse Redis replies per step at batch B:

- the verifier's result flush (its writer thread: the pipeline of B XADDs and their EXPIREs packed,
  run and its replies parsed; bench/result_flush.py's flush), median us;
- the gateway's result reader (services/gateway/result_reader.py, asyncio): B streams each get one
  entry (written outside the clock), timed until every subscriber's queue holds it: the XREAD of B
  streams, its reply parsed, each entry decoded and dispatched; median us.

redis-py uses hiredis whenever it is installed (specd depends on redis[hiredis]); the Python
parser is what a client without it runs.

    .venv/bin/python bench/redis_parser.py --batches 1,64,128 [--steps 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402
import redis.asyncio  # noqa: E402
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser, _HiredisParser, _RESP2Parser  # noqa: E402

from bench.result_flush import flush_us  # noqa: E402
from services.gateway.result_reader import ResultReader  # noqa: E402
from specd.messages import SpecStats  # noqa: E402
from specd.transport.embedded_redis import start_embedded_redis  # noqa: E402
from specd.transport.redis_streams import ResultEntry, result_key  # noqa: E402

PARSERS = {"python": (_RESP2Parser, _AsyncRESP2Parser), "hiredis": (_HiredisParser, _AsyncHiredisParser)}
STATS = SpecStats(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=6, accepted_per_position=[3, 2, 1])


async def _get_each(queues: list[asyncio.Queue]) -> None:
    for q in queues:
        await q.get()


async def reader_delivery_us(url: str, parser, batch: int, steps: int, warmup: int = 20) -> float:
    """Median us from B entries written (one per subscribed stream) to all B delivered by the
    gateway's ResultReader over a client with this parser."""
    writer = redis.Redis.from_url(url)
    client = redis.asyncio.Redis.from_url(url, parser_class=parser)
    reader = ResultReader(client)
    ids = [f"parser-{batch}-{i}" for i in range(batch)]
    queues = [reader.subscribe(i) for i in ids]
    reader.start()
    times = []
    try:
        await asyncio.sleep(0.1)  # the reader's first (empty) reads
        for step in range(steps + warmup):
            pipe = writer.pipeline(transaction=False)
            for i in ids:
                pipe.xadd(result_key(i), ResultEntry(kind="delta", pos=3 * step, tokens=[5, 6, 7],
                                                     spec_stats=STATS).to_fields())
            pipe.execute()
            t0 = time.perf_counter()
            await asyncio.wait_for(_get_each(queues), 10)  # one timer a step (one per get: a task each)
            if step >= warmup:
                times.append((time.perf_counter() - t0) * 1e6)
    finally:
        await reader.stop()
        await client.aclose()
        writer.delete(*[result_key(i) for i in ids])
        writer.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,128")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="each parser this many times, alternating")
    args = ap.parse_args()
    server = start_embedded_redis()
    try:
        print(f"per step, median us over {args.steps} steps; each round alternates the parsers\n")
        print("| batch | flush python | flush hiredis | hiredis / python | reader python | reader hiredis "
              "| hiredis / python |\n|---|---|---|---|---|---|---|")
        for batch in (int(b) for b in args.batches.split(",")):
            flush, read = {n: [] for n in PARSERS}, {n: [] for n in PARSERS}
            for _ in range(args.rounds):
                for name, (sync_parser, async_parser) in PARSERS.items():
                    client = redis.Redis.from_url(server.url, parser_class=sync_parser)
                    flush[name].append(flush_us(client, batch, args.steps)[1])
                    client.close()
                    read[name].append(asyncio.run(reader_delivery_us(server.url, async_parser, batch, args.steps)))
            f = {n: ", ".join(f"{v:.0f}" for v in vs) for n, vs in flush.items()}
            r = {n: ", ".join(f"{v:.0f}" for v in vs) for n, vs in read.items()}
            print(f"| {batch} | {f['python']} | {f['hiredis']} | {min(flush['hiredis']) / min(flush['python']):.2f}x "
                  f"| {r['python']} | {r['hiredis']} | {min(read['hiredis']) / min(read['python']):.2f}x |", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
