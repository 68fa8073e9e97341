"""Cancellation against a real Redis: a client that goes away (Gateway.abandon, the hook the HTTP and
gRPC front ends call on disconnect) cancels its request in the verifier within a step or two; the
engine frees its KV blocks and the entry leaves the queue; other requests are untouched."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from services.gateway.core import Gateway, GatewayConfig
from services.gateway.request_stream import RequestTimings
from specd.sampling_params import SamplingParams
from specd.transport.redis_streams import QueuedRequest, cancel_key, result_key
from tests.services.fault_helpers import make_worker, read_like_the_gateway
from tests.services.verifier_harness import assert_queue_empty, reference_tokens


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_client_disconnect_cancels_in_the_verifier_and_frees_the_cache(redis_url, tiny_models):
    target = tiny_models["target-llama"]
    stream = "cancel:requests"
    client = redis.Redis.from_url(redis_url)
    worker = make_worker(redis_url, target, stream, "v", idle_ms=0)
    free_blocks = worker.engine.runner.kv_cache.allocator.num_free_blocks
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            worker.run_once()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    long = QueuedRequest("cx-long", [5, 6, 7, 8], SamplingParams(max_new_tokens=200, ignore_eos=True))
    short = QueuedRequest("cx-short", [9, 10, 11], SamplingParams(max_new_tokens=12, ignore_eos=True))

    async def client_side():
        gateway = Gateway(GatewayConfig(model=str(target), redis_url=redis_url, request_stream=stream))
        await gateway.start()
        try:
            streams = [await gateway.submit(q, RequestTimings()) for q in (long, short)]
            first = await anext(streams[0])  # the request runs...
            assert first.token_ids
            streams[0].abandon("client disconnected")  # ...and the client goes away
            t0 = time.monotonic()
            while worker.num_cancelled == 0:
                assert time.monotonic() - t0 < 10, "the verifier never saw the cancellation"
                await asyncio.sleep(0.01)
            cancel_s = time.monotonic() - t0
            rest = await streams[1].collect()  # the other request is untouched
            return cancel_s, rest
        finally:
            await gateway.close()

    try:
        cancel_s, rest = asyncio.run(client_side())
        deadline = time.monotonic() + 5
        while worker.active and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(10)
    print(f"\ncancelled in the verifier {cancel_s * 1000:.0f} ms after the client left")
    assert worker.num_cancelled == 1 and not worker.active and not worker.engine.has_unfinished()
    assert rest.token_ids == reference_tokens(target, [short])["cx-short"]
    assert worker.engine.runner.kv_cache.allocator.num_free_blocks == free_blocks  # KV blocks freed
    assert_queue_empty(client, stream)  # acknowledged: not reclaimed or run again by anyone
    assert client.ttl(cancel_key("cx-long")) > 0
    time.sleep(0.2)
    assert not client.exists(result_key("cx-long"))  # its results were deleted, not left to expire
    assert worker.engine.stats.num_output_tokens < 200 + 12


def test_a_request_cancelled_while_queued_never_runs_to_the_end(redis_url, tiny_models):
    target = tiny_models["target-llama"]
    stream = "cancel-queued:requests"
    client = redis.Redis.from_url(redis_url)
    queued = QueuedRequest("cq-0", [5, 6, 7], SamplingParams(max_new_tokens=200, ignore_eos=True))
    client.set(cancel_key("cq-0"), 1, ex=60)  # the client left before any verifier read it
    client.xadd(stream, queued.to_fields())
    other = QueuedRequest("cq-1", [8, 9], SamplingParams(max_new_tokens=5))
    client.xadd(stream, other.to_fields())
    worker = make_worker(redis_url, target, stream, "v", idle_ms=0)
    for _ in range(4):
        worker.run_once()
    assert worker.num_cancelled == 1
    while worker.active:  # (a last decode step queued ahead lands in the next run)
        worker.run_once()
    got = read_like_the_gateway(redis_url, ["cq-1"], timeout=10)["cq-1"]
    assert worker.engine.stats.num_output_tokens < 20
    assert [t for e in got for t in e.tokens] == reference_tokens(target, [other])["cq-1"]
    assert_queue_empty(client, stream)
