"""Result writes: a step's deltas, finals and errors leave in one pipelined Redis round trip.

The worker queues entries while it walks the batch (no I/O), then `flush` sends them all: the
XADDs to the result streams, one EXPIRE per touched stream (every write refreshes the TTL, as the
contract in specd/transport/redis_streams.py says), and last the XACK + XDEL of the finished
requests' entries, so a request leaves the queue (XLEN) only after its final entry is written.

A flush that fails (Redis unreachable) keeps its queue and sends it again, in order, with the next
step's entries: positions make deltas idempotent, so a partly applied pipeline sent twice is
harmless for readers.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from specd.messages import SpecStats
from specd.transport.redis_streams import CONSUMER_GROUP, RESULT_PREFIX, RESULT_TTL_SECONDS, result_key

# Field encodings are the ones ResultEntry.to_fields writes (kept inline: this is the hot path).
_SEPARATORS = (",", ":")


class ResultEmitter:
    """Queues result entries and request acknowledgements; `flush` is one round trip."""

    def __init__(self, client, request_stream: str, group: str = CONSUMER_GROUP,
                 result_prefix: str = RESULT_PREFIX, ttl_seconds: int = RESULT_TTL_SECONDS) -> None:
        self.client = client
        self.request_stream = request_stream
        self.group = group
        self.result_prefix = result_prefix
        self.ttl_seconds = ttl_seconds
        self._entries: list[tuple[str, dict[str, str]]] = []  # (result key, fields) in write order
        self._keys: dict[str, None] = {}  # touched result streams, insertion-ordered
        self._finished_entry_ids: list[bytes | str] = []  # request-stream entries to XACK + XDEL
        self.num_flushes = 0
        self.num_entries_sent = 0
        self.last_flush_seconds = 0.0
        self.last_errors: list[Exception] = []

    @property
    def has_pending(self) -> bool:
        return bool(self._entries or self._finished_entry_ids)

    # ---- queueing (no I/O) ------------------------------------------------------------------
    def delta(self, request_id: str, pos: int, token_ids: list[int]) -> None:
        """Tokens output_token_ids[pos:pos + len(token_ids)] of a running request."""
        self._add(request_id, {"kind": "delta", "pos": str(pos), "tokens": _tokens(token_ids)})

    def final(self, request_id: str, pos: int, token_ids: list[int], finish_reason: str | None,
              spec_stats: SpecStats | None, prompt_tokens: int) -> None:
        """The last entry of a finished request, carrying its last tokens (possibly none)."""
        self._add(request_id, {"kind": "final", "pos": str(pos), "tokens": _tokens(token_ids),
                               "finish_reason": finish_reason or "",
                               "spec_stats": json.dumps(asdict(spec_stats or SpecStats()),
                                                        separators=_SEPARATORS),
                               "prompt_tokens": str(prompt_tokens)})

    def error(self, request_id: str, code: int, message: str, pos: int = 0) -> None:
        """A request that ends without a final: code is HTTP-like (400 bad request, 504 deadline...)."""
        self._add(request_id, {"kind": "error", "pos": str(pos), "tokens": "[]", "code": str(code),
                               "message": message})

    def finish_entry(self, entry_id: bytes | str) -> None:
        """XACK + XDEL this request-stream entry after the results queued before it."""
        self._finished_entry_ids.append(entry_id)

    def _add(self, request_id: str, fields: dict[str, str]) -> None:
        key = result_key(request_id, self.result_prefix)
        self._entries.append((key, fields))
        self._keys[key] = None

    # ---- the round trip ---------------------------------------------------------------------
    def flush(self) -> int:
        """Send everything queued in one pipeline; returns the number of result entries sent.

        Raises redis.ConnectionError / TimeoutError when Redis is unreachable, keeping the queue
        for the next flush; replies Redis refused are left in `last_errors`.
        """
        if not self.has_pending:
            return 0
        t0 = time.perf_counter()
        pipe = self.client.pipeline(transaction=False)
        for key, fields in self._entries:
            pipe.xadd(key, fields)
        for key in self._keys:
            pipe.expire(key, self.ttl_seconds)
        if self._finished_entry_ids:
            pipe.xack(self.request_stream, self.group, *self._finished_entry_ids)
            pipe.xdel(self.request_stream, *self._finished_entry_ids)
        # A command Redis refuses (say, WRONGTYPE on a result key) is reported, not retried: the
        # pipeline ran, and sending it again would fail the same way.
        replies = pipe.execute(raise_on_error=False)
        sent = len(self._entries)
        self._entries, self._keys, self._finished_entry_ids = [], {}, []
        self.num_flushes += 1
        self.num_entries_sent += sent
        self.last_flush_seconds = time.perf_counter() - t0
        self.last_errors = [r for r in replies if isinstance(r, Exception)]
        return sent


def _tokens(token_ids: list[int]) -> str:
    return json.dumps(token_ids, separators=_SEPARATORS)
