"""The gateway's Redis client makes a burst of commands wait for a connection instead of failing
(redis-py 8's default asyncio pool raises "Too many connections" past 100 in flight)."""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions

from services.gateway.redis_client import gateway_redis


def test_a_burst_past_the_pool_size_waits_for_connections(redis_url, client):
    def connected() -> int:
        return client.info("clients")["connected_clients"]

    async def burst():
        gateway = gateway_redis(redis_url, max_connections=8)
        try:
            ids = await asyncio.gather(*[gateway.xadd("specd:test:burst", {"n": str(i)}) for i in range(300)])
            return len(set(ids)), connected(), await gateway.xlen("specd:test:burst")
        finally:
            await gateway.delete("specd:test:burst")
            await gateway.aclose()

    before = connected()
    distinct, during, length = asyncio.run(burst())
    assert distinct == length == 300  # every command ran, none failed
    assert 1 <= during - before <= 8  # on at most the pool's size of connections (Redis' count)


def test_a_connection_never_freed_fails_the_waiting_command_with_a_redis_error(redis_url, monkeypatch):
    monkeypatch.setattr("services.gateway.redis_client.COMMAND_TIMEOUT_S", 0.2)

    async def starved():
        client = gateway_redis(redis_url, max_connections=1)
        held = await client.connection_pool.get_connection()  # as the result reader holds its own
        try:
            with pytest.raises(redis.exceptions.ConnectionError):  # the gateway answers it with a 503
                await client.ping()
        finally:
            await client.connection_pool.release(held)
            await client.aclose()

    asyncio.run(starved())
