"""`Idempotency-Key`: a retried request attaches to the one already queued or running instead of
starting it again, on any gateway (the record and the result streams are in Redis).

The first request with a key records its request ids (one a choice) under the key, atomically
(SET NX), before it is queued; a request that finds the record reads those requests' result
streams from their start, which a keyed request leaves to their TTL instead of deleting them. A
client that disconnects does not cancel a keyed request: its retry will want it. The record holds
a fingerprint of the request, so a key reused for another request is refused (422).
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


@dataclass
class Earlier:
    """The requests an earlier call with the same key queued."""

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


class IdempotencyKeys:
    def __init__(self, client, *, ttl_s: int = RESULT_TTL_SECONDS) -> None:
        self.client = client
        self.ttl_s = ttl_s  # as long as the result streams a retry would read

    async def claim(self, key: str, request_print: str, request_ids: list[str], created: int) -> Earlier | None:
        """None: the key is ours now (queue the requests); else the earlier call's requests."""
        record = json.dumps({"fingerprint": request_print, "request_ids": request_ids, "created": created})
        for _ in range(2):  # the record may expire between SET NX and GET: then claim it
            if await self.client.set(KEY_PREFIX + key, record, nx=True, ex=self.ttl_s):
                return None
            raw = await self.client.get(KEY_PREFIX + key)
            if raw is not None:
                earlier = json.loads(raw)
                if earlier["fingerprint"] != request_print:
                    raise GatewayError(422, f"{HEADER}: this key was used for another request", param=HEADER)
                return Earlier(list(earlier["request_ids"]), int(earlier["created"]))
        raise GatewayError(503, f"{HEADER}: could not record the key; retry", param=HEADER)

    async def release(self, key: str) -> None:
        """The keyed requests were not queued (refused): a retry may queue them."""
        await self.client.delete(KEY_PREFIX + key)
