"""`Idempotency-Key`: a retried request attaches to the one already queued or running instead of
starting it again, on any gateway (the record and the result streams are in Redis).

The first call with a key records its request ids (one a choice) under the key, atomically; every
call with the key, the first included, then queues each request through one script that XADDs it
only if no call has yet (the record marks it queued in the same step). So a retry after a gateway
died between recording and queueing queues the request itself, and two calls racing queue it once.
Result streams of keyed requests are left to their TTL instead of deleted, and a client that
disconnects cancels nothing: its retry reads the run from the start. The record holds a
fingerprint of the request, so a key reused for another request is refused (422).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from services.gateway.errors import GatewayError
from specd.transport.redis_streams import RESULT_TTL_SECONDS

KEY_PREFIX = "specd:idempotency:"
HEADER = "Idempotency-Key"
METADATA = "idempotency-key"  # gRPC metadata keys are lower case
MAX_KEY_CHARS = 255

# KEYS[1] the record; ARGV: fingerprint, request ids (JSON), created, ttl. The record as it stands:
# a new one is written whole (nil returned), an existing one returned as [fingerprint, ids, created].
_CLAIM = """
local found = redis.call('HMGET', KEYS[1], 'fingerprint', 'request_ids', 'created')
if found[1] then return found end
redis.call('HSET', KEYS[1], 'fingerprint', ARGV[1], 'request_ids', ARGV[2], 'created', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
return nil
"""


@dataclass
class Earlier:
    """The requests an earlier call with the same key recorded."""

    request_ids: list[str]
    created: int


def check_key(key: str) -> str:
    if not 1 <= len(key) <= MAX_KEY_CHARS or not key.isprintable():
        raise GatewayError(400, f"{HEADER}: 1-{MAX_KEY_CHARS} printable characters", param=HEADER)
    return key


def fingerprint(route: str, body: dict) -> str:
    """What makes two calls the same request (the route and every field sent)."""
    text = json.dumps([route, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def record_key(key: str) -> str:
    return KEY_PREFIX + key


def queued_field(request_id: str) -> str:
    """The record's field that marks a request queued (the XADD script sets it)."""
    return "queued:" + request_id


class IdempotencyKeys:
    def __init__(self, client, *, ttl_s: int = RESULT_TTL_SECONDS) -> None:
        self.client = client
        self.ttl_s = ttl_s  # as long as the result streams a retry would read
        self._claim = client.register_script(_CLAIM)

    async def claim(self, key: str, request_print: str, request_ids: list[str], created: int) -> Earlier | None:
        """None: the key is ours now; else the requests an earlier call recorded under it."""
        found = await self._claim(keys=[record_key(key)],
                                  args=[request_print, json.dumps(request_ids), created, self.ttl_s])
        if found is None:
            return None
        earlier_print, ids, earlier_created = (v.decode() if isinstance(v, bytes) else v for v in found)
        if earlier_print != request_print:
            raise GatewayError(422, f"{HEADER}: this key was used for another request", param=HEADER)
        return Earlier(json.loads(ids), int(earlier_created))

    async def release(self, key: str) -> None:
        """The first call's requests were refused before any was queued: a retry may start over."""
        await self.client.delete(record_key(key))
