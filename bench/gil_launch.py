"""A GIL turn at the launch (CPU, real Redis): how long the engine thread waits to take the GIL back
in a call that gives it up right before its forward (the launch mark), while the result writer's
flush is on its way, by where the loop stages its next verify batch.

Why: the device clock starts at the step's first mark, so a wait for the GIL between it and the
replay call counts as forward time; a flush on the writer thread may hold the GIL then.

Per step, as the verifier's loop runs it at batch B: the launch (timed: the wait), the forward (F ms
of host idle), the commit's host work (C us), the drafts sent ahead to a drafter process (it
answers after D us), the stage (S us) and the emit (B deltas handed to a ResultWriter over the
embedded Redis), then the wait for the drafts. Orders:
  step   staged at the step's end, before the emit (SPECD_STAGE_VERIFY=1, the default)
  none   no stage: the fill after the drafts arrive, before the launch (SPECD_STAGE_VERIFY=0)
  sync   staged at the step's end, the flush on the loop's thread (SPECD_ASYNC_EMIT=0)
Reported per order: the launch call's wait (median, p90, mean us) and the launch path (from the
drafts' arrival to the launch call's return, fill included).

    .venv/bin/python -m bench.gil_launch --batch 1 --steps 300
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time

ORDERS = ("step", "none", "sync")


def busy_us(us: float) -> None:
    """Host work holding the GIL (Python bytecode, as the fill and the commit are)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def drafter(sock: socket.socket, answer_us: float) -> None:
    """The drafter process: answers each request after answer_us (its own interpreter, its own GIL)."""
    while sock.recv(1):
        busy_us(answer_us)
        sock.sendall(b"d")


def run_order(order: str, redis_url: str, batch: int, steps: int, forward_ms: float, commit_us: float,
              stage_us: float, drafter_sock: socket.socket) -> dict:
    import redis

    from services.verifier.results.flush import ResultQueue
    from services.verifier.results.writer import ResultWriter

    result_queue = ResultQueue(redis.Redis.from_url(redis_url), f"gil-{order}:requests")
    writer = ResultWriter(result_queue)
    waits, paths = [], []
    # The launch call: a one-byte pipe write (~0.5 us, the GIL given up around it, as a CUDA
    # event's record gives it up); time.sleep(0) would sleep ~50 us of timer slack here.
    mark_r, mark_w = os.pipe()
    arrived = time.perf_counter()
    try:
        for step in range(steps):
            if order == "none":
                busy_us(stage_us)  # the fill, after the drafts
            t0 = time.perf_counter()
            os.write(mark_w, b"m")  # gives up the GIL and takes it back, as the launch mark's record does
            t1 = time.perf_counter()
            waits.append(t1 - t0)
            paths.append(t1 - arrived)
            time.sleep(forward_ms * 1e-3)  # the forward: the host waits for the device
            os.read(mark_r, 16)
            busy_us(commit_us)
            drafter_sock.sendall(b"r")  # the next step's drafts, asked ahead
            if order in ("step", "sync"):
                busy_us(stage_us)
            writer.wait()
            for i in range(batch):
                result_queue.delta(f"gil-{order}-{i}", 4 * step, [1, 2, 3, 4])
            if order == "sync":
                writer.flush()
            else:
                writer.start()
            drafter_sock.recv(1)
            arrived = time.perf_counter()
        writer.wait()
    finally:
        writer.close()
        os.close(mark_r)
        os.close(mark_w)
    warm = steps // 10  # the first steps create the streams
    waits, paths = sorted(waits[warm:]), sorted(paths[warm:])
    us = 1e6
    return {"order": order, "wait_median_us": round(statistics.median(waits) * us, 1),
            "wait_p90_us": round(waits[int(0.9 * len(waits))] * us, 1),
            "wait_mean_us": round(statistics.fmean(waits) * us, 1),
            "path_median_us": round(statistics.median(paths) * us, 1),
            "path_mean_us": round(statistics.fmean(paths) * us, 1)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--orders", default=",".join(ORDERS))
    p.add_argument("--forward-ms", type=float, default=5.5)
    p.add_argument("--commit-us", type=float, default=140.0)
    p.add_argument("--stage-us", type=float, default=100.0)
    p.add_argument("--drafter-us", type=float, default=300.0, help="the drafter's answer time (round trip)")
    p.add_argument("--rounds", type=int, default=2, help="each order this many times, interleaved")
    args = p.parse_args(argv)
    orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    unknown = sorted(set(orders) - set(ORDERS))
    if unknown:
        p.error(f"--orders: unknown {unknown}; choose from {list(ORDERS)}")

    from specd.transport.embedded_redis import start_embedded_redis

    server = start_embedded_redis()
    ours, theirs = socket.socketpair()
    proc = mp.get_context("spawn").Process(target=drafter, args=(theirs, args.drafter_us), daemon=True)
    proc.start()
    rows: list[dict] = []
    try:
        for _ in range(args.rounds):
            for order in orders:
                rows.append(run_order(order, server.url, args.batch, args.steps, args.forward_ms,
                                      args.commit_us, args.stage_us, ours))
    finally:
        ours.close()
        proc.join(timeout=5)
        server.stop()
    print(f"batch {args.batch}, {args.steps} steps an order and round; forward {args.forward_ms} ms, commit "
          f"{args.commit_us} us, stage {args.stage_us} us, drafter {args.drafter_us} us\n")
    print("| order | launch call's wait us: median / p90 / mean | drafts to launch us: median / mean |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['order']} | {r['wait_median_us']} / {r['wait_p90_us']} / {r['wait_mean_us']} | "
              f"{r['path_median_us']} / {r['path_mean_us']} |")
    return rows


if __name__ == "__main__":
    main()
