"""The gateway's result reader on a real Redis: a request that subscribes (or is cancelled) while
the reader's XREAD blocks on quiet streams is served at once, not after the block.

The blocks here are 3 s long so that "at once" and "after the block" cannot be confused on a
loaded CI machine; the gateway's is 50 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis.asyncio

from services.gateway.result_reader import ResultReader
from specd.transport.redis_streams import ResultEntry, cancel_key, result_key

BLOCK_MS = 3000


def _delta(pos: int, tokens: list[int]) -> dict:
    return ResultEntry(kind="delta", pos=pos, tokens=tokens).to_fields()


@contextlib.asynccontextmanager
async def blocking_reader(url: str, block_ms: int = BLOCK_MS):
    """A started reader whose XREAD blocks on a stream nobody writes, and a client of its Redis;
    both stopped on exit."""
    client = redis.asyncio.Redis.from_url(url)
    reader = ResultReader(client, block_ms=block_ms)
    reader.subscribe("quiet")  # a stream with nothing to read: the XREAD blocks
    reader.start()
    try:
        await asyncio.sleep(0.2)
        yield client, reader
    finally:
        await reader.stop()
        await client.aclose()


async def _first_entry_s(client, reader: ResultReader, request_id: str) -> float:
    """Subscribe while the read blocks, write the request's first entry; seconds until delivered."""
    t0 = time.monotonic()
    queue = reader.subscribe(request_id)
    await client.xadd(result_key(request_id), _delta(0, [5, 6]))
    entry = await asyncio.wait_for(queue.get(), 2 * BLOCK_MS / 1000)
    assert (entry.kind, entry.pos, entry.tokens) == ("delta", 0, [5, 6])
    return time.monotonic() - t0


def test_a_new_request_joins_a_blocked_read_at_once(redis_url):
    async def main():
        async with blocking_reader(redis_url) as (client, reader):
            return [await _first_entry_s(client, reader, f"joiner-{i}") for i in range(3)]

    waits = asyncio.run(main())
    assert max(waits) < 0.3 * BLOCK_MS / 1000, waits  # without the unblock: ~BLOCK_MS each


def test_the_reader_finds_its_connection_again_after_it_is_killed(redis_url):
    """The unblock names the read connection's id; a reconnect changes it, and a stale id would
    unblock nobody (or another client)."""

    async def main():
        async with blocking_reader(redis_url) as (client, reader):
            old_id = reader._reader_id
            await client.client_kill_filter(_id=old_id)  # the blocked XREAD fails; the reader retries
            await asyncio.sleep(0.5)
            wait = await _first_entry_s(client, reader, "after-kill")
            return old_id, reader._reader_id, wait

    old_id, new_id, wait = asyncio.run(main())
    assert new_id is not None and new_id != old_id
    assert wait < 0.3 * BLOCK_MS / 1000, wait


def test_a_cancel_reaches_redis_without_waiting_for_the_read(redis_url):
    async def main():
        async with blocking_reader(redis_url) as (client, reader):
            reader.subscribe("to-cancel")
            await asyncio.sleep(0.2)  # the read that names it blocks now
            t0 = time.monotonic()
            reader.cancel("to-cancel")
            while not await client.exists(cancel_key("to-cancel")):
                assert time.monotonic() - t0 < 2 * BLOCK_MS / 1000, "the cancel key was never set"
                await asyncio.sleep(0.005)
            return time.monotonic() - t0

    assert asyncio.run(main()) < 0.3 * BLOCK_MS / 1000


def test_stop_returns_the_read_connection_to_the_pool(redis_url):
    async def main():
        async with blocking_reader(redis_url) as (client, reader):
            pool = client.connection_pool
            in_use_while_running = len(list(pool._get_in_use_connections()))
            await reader.stop()  # stopping twice (again on exit) is harmless
            return in_use_while_running, len(list(pool._get_in_use_connections()))

    running, after = asyncio.run(main())
    assert running >= 1 and after == 0


def test_a_redis_that_refuses_client_commands_still_serves_every_request(redis_url, client):
    """An ACL (as some managed Redis services have) may deny CLIENT ID / UNBLOCK: the reader then
    joins new streams on the next read instead of failing every read."""
    client.acl_setuser("no-client-cmds", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                       commands=["+@all", "-client"])
    limited_url = redis_url.replace("redis://", "redis://no-client-cmds:pw@")

    async def main():
        async with blocking_reader(limited_url, block_ms=200) as (limited, reader):
            assert not reader.cut_reads_short  # it asked for its id once, was refused, and went on
            return [await _first_entry_s(limited, reader, f"limited-{i}") for i in range(2)]

    waits = asyncio.run(main())
    assert max(waits) < 2.0, waits  # served, within a block or so (no cut), never stuck
