"""The services' Redis clients parse replies with hiredis (a dependency: redis[hiredis]), and what
the gateway's result reader delivers does not depend on the parser."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import redis
import redis.asyncio
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser, _HiredisParser, _RESP2Parser

from services.gateway.result_reader import ResultReader
from specd.messages import SpecStats
from specd.transport.redis_streams import ResultEntry, result_key


def test_the_services_clients_parse_with_hiredis(redis_url):
    # Built as services/verifier/server.py and services/gateway/core.py build theirs.
    sync_client = redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=10)
    conn = sync_client.connection_pool.get_connection()
    try:
        assert isinstance(conn._parser, _HiredisParser)
    finally:
        sync_client.connection_pool.release(conn)
        sync_client.close()

    async def async_parser():
        client = redis.asyncio.Redis.from_url(redis_url)
        conn = await client.connection_pool.get_connection()
        try:
            return type(conn._parser)
        finally:
            await client.connection_pool.release(conn)
            await client.aclose()

    assert asyncio.run(async_parser()) is _AsyncHiredisParser


ENTRIES = [
    ResultEntry(kind="delta", pos=0, tokens=[5, 6, 7],
                spec_stats=SpecStats(num_drafts=1, num_draft_tokens=3, num_accepted_tokens=2,
                                     accepted_per_position=[1, 1, 0])),
    ResultEntry(kind="delta", pos=3, tokens=[128000, 0, 99999]),
    ResultEntry(kind="final", pos=6, tokens=[2], finish_reason="stop", prompt_tokens=11,
                spec_stats=SpecStats(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4,
                                     accepted_per_position=[2, 1, 1])),
]
ERROR = ResultEntry(kind="error", code=400, message="bad schema: ünïcode \"quoted\"\nsecond line")


async def _delivered(url: str, parser, tag: str) -> dict[str, list[ResultEntry]]:
    writer = redis.asyncio.Redis.from_url(url)
    client = redis.asyncio.Redis.from_url(url, parser_class=parser)
    reader = ResultReader(client)
    queues = {rid: reader.subscribe(rid) for rid in (f"{tag}-ok", f"{tag}-err")}
    reader.start()
    try:
        for entry in ENTRIES:
            await writer.xadd(result_key(f"{tag}-ok"), entry.to_fields())
        await writer.xadd(result_key(f"{tag}-err"), ERROR.to_fields())
        out = {}
        for rid, queue in queues.items():
            got = []
            while not got or got[-1].kind == "delta":
                got.append(await asyncio.wait_for(queue.get(), 10))
            out[rid.removeprefix(tag)] = got
        return out
    finally:
        await reader.stop()
        await client.aclose()
        await writer.aclose()


def test_the_result_reader_delivers_the_same_entries_with_either_parser(redis_url):
    python = asyncio.run(_delivered(redis_url, _AsyncRESP2Parser, "parser-py"))
    hiredis = asyncio.run(_delivered(redis_url, _AsyncHiredisParser, "parser-hi"))
    # The reader leaves deltas' running stats unread (the gateway uses the final's).
    want = [replace(e, spec_stats=None) if e.kind == "delta" else e for e in ENTRIES]
    assert hiredis == python == {"-ok": want, "-err": [ERROR]}
    assert want[-1].spec_stats.num_accepted_tokens == 4  # the final's stats do arrive


def test_a_deltas_stats_are_read_unless_the_reader_says_not():
    fields = {k.encode(): v.encode() for k, v in ENTRIES[0].to_fields().items()}
    assert ResultEntry.from_fields(fields) == ENTRIES[0]  # a resuming verifier carries on counting
    assert ResultEntry.from_fields(fields, delta_stats=False) == replace(ENTRIES[0], spec_stats=None)
    final = {k.encode(): v.encode() for k, v in ENTRIES[2].to_fields().items()}
    assert ResultEntry.from_fields(final, delta_stats=False) == ENTRIES[2]


def test_a_pipeline_of_xadds_and_expires_replies_alike_with_either_parser(redis_url):
    replies = {}
    for name, parser in (("python", _RESP2Parser), ("hiredis", _HiredisParser)):
        client = redis.Redis.from_url(redis_url, parser_class=parser)
        pipe = client.pipeline(transaction=False)
        key = f"specd:test:parser:{name}"
        pipe.xadd(key, ENTRIES[0].to_fields(), id="1-1")
        pipe.expire(key, 60)
        pipe.xadd(key, ENTRIES[1].to_fields(), id="1-0")  # an id below the last: an error in the reply
        replies[name] = [r if not isinstance(r, Exception) else type(r) for r in pipe.execute(raise_on_error=False)]
        client.delete(key)
        client.close()
    assert replies["hiredis"] == replies["python"] == [b"1-1", True, redis.ResponseError]
