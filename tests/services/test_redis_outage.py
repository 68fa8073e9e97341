"""Redis loss under a real verifier process: Redis is SIGKILLed mid-generation and restarted empty on
the same port; the verifier does not crash, reconnects with backoff, writes the results it held
once Redis is back, recreates its consumer group, and serves new requests exactly."""

from __future__ import annotations

import signal
import time

import redis

from specd.sampling_params import SamplingParams
from specd.transport.embedded_redis import start_embedded_redis
from specd.transport.redis_streams import QueuedRequest
from tests.services.verifier_harness import (SUB_STREAM, VerifierProcess, assert_queue_empty, check_answers,
                                             collect, enqueue, make_requests, reference_tokens)


def test_verifier_survives_redis_restart_and_serves_on(tiny_models, tmp_path):
    target = tiny_models["target-llama"]
    server = start_embedded_redis()
    port = server.port
    verifier = VerifierProcess(server.url, target, SUB_STREAM, "outage", tmp_path)
    try:
        verifier.wait_serving()
        client = redis.Redis.from_url(server.url)
        long = [QueuedRequest(f"out-{i}", [5 + i, 6, 7], SamplingParams(max_new_tokens=150, ignore_eos=True))
                for i in range(3)]
        enqueue(client, SUB_STREAM, long)
        collect(client, [r.request_id for r in long], stop_after=lambda res: all(res.values()))
        server.process.send_signal(signal.SIGKILL)  # Redis dies mid-generation, losing everything
        server.process.wait()
        time.sleep(1.5)
        assert verifier.proc.poll() is None, verifier.log()
        server = start_embedded_redis(port=port)  # back, empty, on the same address
        client = redis.Redis.from_url(server.url)

        # What the verifier held is written once Redis answers again: each request's final arrives.
        finals = collect(client, [r.request_id for r in long], timeout=60)
        for rid, entries in finals.items():
            assert entries[-1].kind == "final" and entries[-1].pos + len(entries[-1].tokens) == 150, rid
        # The group is recreated and new requests are served exactly.
        fresh = make_requests(4, seed=21, prefix="after-outage")
        enqueue(client, SUB_STREAM, fresh)
        check_answers(collect(client, [r.request_id for r in fresh]), reference_tokens(target, fresh))
        assert_queue_empty(client, SUB_STREAM)
        assert verifier.proc.poll() is None
        assert "redis unavailable" in verifier.log()
        assert verifier.terminate() == 0, verifier.log()
    finally:
        verifier.close()
        server.stop()
