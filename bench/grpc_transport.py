"""A bidirectional gRPC stream's round trip between two processes, back to back and with the
client busy between messages, as the verifier is while the device runs a step.

The drafter round trip of a remote proposer is one message each way on a DraftSteps stream
(specd/clients/drafter_stream.py, step_stream.py): a sender thread pulls requests from a queue, a reader thread
puts responses on another, the caller blocks on that queue. Here the same pattern runs against an
echo server in a process of its own; between messages the client spins for `gap` ms (the engine
thread's wait for the device), so the server's threads sleep that long, as the drafter's do.

    python -m bench.grpc_transport [--pings 1000] [--gaps-ms 0,1,4] [--payload 200] [--server-spin]

It prints the median and p90 round trip per gap, and each against gap 0. --server-spin runs a
thread in the server process that keeps yielding (time.sleep(0)): does a core kept awake help?
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import statistics
import threading
import time
from concurrent import futures

import grpc

SERVICE, METHOD = "specd.bench.Echo", "/specd.bench.Echo/Stream"


def _echo(request_iterator, context):
    yield from request_iterator


def _serve(port_out, stop, spin) -> None:
    """The echo server's process: bind any free port, report it, serve until `stop` is set."""
    if spin:
        threading.Thread(target=lambda: [time.sleep(0) for _ in iter(int, 1)], daemon=True).start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(_echo)}),))
    port_out.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(0)


def round_trips(address: str, pings: int, payload: int, gap_s: float) -> list[float]:
    """Seconds per round trip, DrafterStream's pattern (queue -> sender thread; reader thread ->
    queue), spinning gap_s between round trips."""
    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=30)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    responses: queue.SimpleQueue = queue.SimpleQueue()

    def outgoing():
        while (message := requests.get()) is not None:
            yield message

    call = channel.stream_stream(METHOD)(outgoing())
    reader = threading.Thread(target=lambda: [responses.put(r) for r in call], daemon=True)
    reader.start()
    message = os.urandom(payload)
    times = []
    for i in range(pings + pings // 10):  # the first tenth warms up
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:
            pass
        t0 = time.perf_counter()
        requests.put(message)
        responses.get(timeout=10)
        if i >= pings // 10:
            times.append(time.perf_counter() - t0)
    requests.put(None)
    reader.join(5)
    channel.close()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pings", type=int, default=1000)
    ap.add_argument("--gaps-ms", default="0,1,4", help="client busy time between round trips")
    ap.add_argument("--payload", type=int, default=200, help="bytes per message")
    ap.add_argument("--server-spin", action="store_true")
    args = ap.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    port_out, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(port_out, stop, args.server_spin), daemon=True)
    server.start()
    try:
        address = f"127.0.0.1:{port_out.get(timeout=60)}"
        results = {gap: round_trips(address, args.pings, args.payload, gap / 1e3)
                   for gap in map(float, args.gaps_ms.split(","))}
    finally:
        stop.set()
        server.join(10)
    print(f"| client busy between round trips ms | round trip median us | p90 us | vs back to back "
          f"({args.pings} pings, {args.payload} B, echo server in its own process) |")
    print("|---|---|---|---|")
    base = statistics.median(next(iter(results.values())))
    for gap, times in results.items():
        median, p90 = statistics.median(times), sorted(times)[int(0.9 * len(times))]
        print(f"| {gap:g} | {median * 1e6:.0f} | {p90 * 1e6:.0f} | {median / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
