"""The gateway's Redis client: one asyncio connection pool that makes a burst wait, not fail.

Every request in flight runs its own commands (the submit's XADD, a cancel); the result reader
holds one connection for its XREADs. redis-py's default asyncio pool (redis 8: at most 100
connections) raises MaxConnectionsError ("Too many connections") for the 101st command in flight:
a burst of 128 requests got 503s. A blocking pool makes a command wait for a free connection
instead (commands take well under a millisecond), up to the socket timeout.
"""

from __future__ import annotations

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

MAX_CONNECTIONS = 128  # past this, commands queue for a connection
CONNECT_TIMEOUT_S = 1.0  # fail fast when Redis is down: one short retry, then 503 (never a hang)
COMMAND_TIMEOUT_S = 10.0  # a reply, or a free connection, within this


def gateway_redis(url: str, max_connections: int = MAX_CONNECTIONS) -> redis.asyncio.Redis:
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=COMMAND_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=COMMAND_TIMEOUT_S,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 1))
    return redis.asyncio.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it
