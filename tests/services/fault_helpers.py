"""Helpers shared by the fault-tolerance tests: in-process verifier workers on a real Redis, and
the gateway's own result reader (services/gateway/result_reader.py) as the client that deduplicates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis
import redis.asyncio

from services.gateway.result_reader import ResultReader
from services.verifier.claims import ClaimConfig
from services.verifier.worker import VerifierWorker, WorkerConfig
from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig, SpeculativeConfig

ENGINE = dict(block_size=8, session_len=256)
# Fixed k: a resumed request's speculation figures equal a fault-free run's only when its draft
# lengths are a function of its tokens (adaptive ones follow the batch and measured step times).
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)


def make_worker(redis_url: str, target: Path, stream: str, consumer: str, idle_ms: int = 300,
                spec: SpeculativeConfig | None = NGRAM, max_batch_size: int = 8, **engine_kw) -> VerifierWorker:
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=max_batch_size, **ENGINE),
                          spec, **engine_kw)
    worker = VerifierWorker(engine, redis.Redis.from_url(redis_url),
                            WorkerConfig(consumer=consumer, request_stream=stream, log_interval_s=0,
                                         claims=ClaimConfig(idle_ms=idle_ms)))
    worker.ensure_group()
    return worker


def read_like_the_gateway(redis_url: str, request_ids: list[str], timeout: float = 60.0) -> dict:
    """Every request's entries as the gateway's ResultReader hands them to a client (deduplicated
    by position): {request_id: [ResultEntry, ...]} up to its final or error."""

    async def main():
        client = redis.asyncio.Redis.from_url(redis_url)
        reader = ResultReader(client)
        queues = {rid: reader.subscribe(rid) for rid in request_ids}
        reader.start()
        out = {rid: [] for rid in request_ids}

        async def drain(rid):
            while True:
                entry = await queues[rid].get()
                out[rid].append(entry)
                if entry.kind != "delta":
                    return

        try:
            await asyncio.wait_for(asyncio.gather(*(drain(r) for r in request_ids)), timeout)
        finally:
            await reader.stop()
            await client.aclose()
        return out

    return asyncio.run(main())


def delivered_tokens(entries) -> list[int]:
    return [t for e in entries if e.kind in ("delta", "final") for t in e.tokens]
