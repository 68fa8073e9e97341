"""The result queue: a step's deltas, finals and errors leave in one pipelined Redis round trip.

The worker queues entries while it walks the batch (no I/O); `flush` sends the XADDs, the EXPIREs
that keep their TTL, and last the XACK + XDEL of the finished requests' entries, so a request
leaves the queue only after its final entry is written. Riders (the running requests' heartbeat,
the cancellation poll) queue their commands after the results and read their own replies, so a
step still costs one round trip.

A stream's first write, its last and any write a tenth of the TTL or more after its last EXPIRE
carry one, so it lives at least 0.9 TTL past any write (specd/transport/redis_streams.py) without
an EXPIRE per stream per step (at batch 64, half the pipeline). An EXPIRE counts once its flush went
through. A failed flush keeps its queue and sends it again with the next step's entries (positions
make deltas idempotent); a rider's commands are not kept, it asks again next step.

A flush is three phases so that its round trip can run on another thread (results/writer.py):
`prepare` fills a ResultFlush's pipeline, `ResultFlush.execute` is the round trip and touches only
the ResultFlush, and `complete` (or `requeue`) brings the outcome back on the loop's thread.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from specd.messages import SpecStats
from specd.transport.redis_streams import CONSUMER_GROUP, RESULT_PREFIX, RESULT_TTL_SECONDS, result_key

# Field encodings are the ones ResultEntry.to_fields writes (kept inline: this is the hot path).
# One encoder: json.dumps with separators builds a new JSONEncoder per call (2.1 vs 1.2 us for a
# delta's tokens), and a batch of 64 writes two JSON fields per request per step.
_JSON = json.JSONEncoder(separators=(",", ":"))


class PipelineRider(Protocol):
    """Commands that share the result pipeline. Both methods run on the loop's thread; with the
    writer thread, `answer` comes when the loop next waits for the flush (a step later)."""

    def queue(self, pipe) -> int:
        """Add commands to the pipeline; returns how many."""

    def answer(self, replies: list) -> None:
        """Their replies, in order (exceptions for refused commands)."""


@dataclass(slots=True)
class ResultFlush:
    """One round trip: the results taken out of the ResultQueue, and the riders' commands."""

    entries: list[tuple[str, dict[str, str]]]  # (result key, fields) in write order
    keys: dict[str, bool]  # touched result streams, insertion-ordered -> whether their last entry is here
    finished_entry_ids: list  # request-stream entries to XACK + XDEL, after the entries
    deleted_keys: list[str]  # result streams of cancelled requests
    riders: list  # PipelineRider, answered by ResultQueue.complete
    pipe: Any = None  # the filled pipeline (redis-py), sent by execute
    num_own: int = 0  # commands of the results; the riders' follow
    rider_counts: list[int] = field(default_factory=list)  # commands per rider, in order
    replies: list | None = None  # set by execute
    seconds: float = 0.0  # the round trip, measured by execute
    expired_keys: list[str] = field(default_factory=list)  # streams whose TTL this flush refreshes
    prepared_at: float = 0.0  # time.monotonic() of prepare

    def execute(self) -> None:
        """The round trip (any thread: it touches only this ResultFlush). Raises what redis-py raises."""
        t0 = time.perf_counter()
        # A command Redis refuses (say, WRONGTYPE on a result key) is reported, not retried: the
        # pipeline ran, and sending it again would fail the same way.
        self.replies = self.pipe.execute(raise_on_error=False)
        self.seconds = time.perf_counter() - t0

    def is_finishing(self, entry_id: bytes | str) -> bool:
        """Whether this flush acknowledges the entry."""
        return _sid(entry_id) in {_sid(e) for e in self.finished_entry_ids}


class ResultQueue:
    """Queues result entries and request acknowledgements; `flush` is one round trip."""

    def __init__(self, client, request_stream: str, group: str = CONSUMER_GROUP,
                 result_prefix: str = RESULT_PREFIX, ttl_seconds: int = RESULT_TTL_SECONDS) -> None:
        self.client = client
        self.request_stream = request_stream
        self.group = group
        self.result_prefix = result_prefix
        self.ttl_seconds = ttl_seconds
        self._entries: list[tuple[str, dict[str, str]]] = []  # (result key, fields) in write order
        self._keys: dict[str, bool] = {}  # touched result streams, insertion-ordered -> last entry queued
        self.refresh_seconds = ttl_seconds / 10  # a stream's TTL is refreshed by its first write past this
        self._refreshed: dict[str, float] = {}  # result key -> monotonic time its last EXPIRE went through
        self._last_prune = time.monotonic()
        self._finished_entry_ids: list[bytes | str] = []  # request-stream entries to XACK + XDEL
        self._deleted_keys: list[str] = []  # result streams of cancelled requests
        self.num_flushes = 0
        self.num_entries_sent = 0
        self.last_flush_seconds = 0.0
        self.last_errors: list[Exception] = []

    @property
    def has_pending(self) -> bool:
        return bool(self._entries or self._finished_entry_ids or self._deleted_keys)

    def is_finishing(self, entry_id: bytes | str) -> bool:
        """Whether the entry's XACK + XDEL is queued (its request was answered here)."""
        return _sid(entry_id) in {_sid(e) for e in self._finished_entry_ids}

    # ---- queueing (no I/O) ------------------------------------------------------------------
    def delta(self, request_id: str, pos: int, token_ids: list[int], spec_stats: SpecStats | None = None,
              logprobs: list | None = None) -> None:
        """Tokens output_token_ids[pos:pos + len(token_ids)] of a running request, and the request's
        speculation figures so far (what a verifier that resumes the request carries on from).
        logprobs: one TokenLogprob (or None) per token, for requests that asked; else no field."""
        fields = {b"kind": b"delta", b"pos": b"%d" % pos, b"tokens": _tokens(token_ids)}
        if spec_stats is not None:
            fields[b"spec_stats"] = _stats(spec_stats)
        if logprobs is not None:
            fields[b"logprobs"] = _logprobs(logprobs)
        self._add(request_id, fields, last=False)

    def final(self, request_id: str, pos: int, token_ids: list[int], finish_reason: str | None,
              spec_stats: SpecStats | None, prompt_tokens: int, logprobs: list | None = None,
              cached_tokens: int = 0) -> None:
        """The last entry of a finished request, carrying its last tokens (possibly none);
        cached_tokens: its prompt tokens found in the prefix cache."""
        fields = {b"kind": b"final", b"pos": b"%d" % pos, b"tokens": _tokens(token_ids),
                  b"finish_reason": (finish_reason or "").encode(),
                  b"spec_stats": _JSON.encode(asdict(spec_stats or SpecStats())).encode(),
                  b"prompt_tokens": b"%d" % prompt_tokens, b"cached_tokens": b"%d" % cached_tokens}
        if logprobs is not None:
            fields[b"logprobs"] = _logprobs(logprobs)
        self._add(request_id, fields, last=True)

    def error(self, request_id: str, code: int, message: str, pos: int = 0) -> None:
        """A request that ends without a final: code is HTTP-like (400 bad request, 504 deadline...)."""
        self._add(request_id, {b"kind": b"error", b"pos": b"%d" % pos, b"tokens": b"[]", b"code": b"%d" % code,
                               b"message": message.encode()}, last=True)

    def finish_entry(self, entry_id: bytes | str) -> None:
        """XACK + XDEL this request-stream entry after the results queued before it."""
        self._finished_entry_ids.append(entry_id)

    def discard(self, request_id: str) -> None:
        """Delete a request's result stream (cancelled: nobody reads it) after the writes queued."""
        self._deleted_keys.append(result_key(request_id, self.result_prefix))

    def _add(self, request_id: str, fields: dict[bytes, bytes], last: bool) -> None:
        # Fields as bytes: redis-py packs bytes as they are, where each str or int argument costs
        # an encode call on the writer thread (an XADD 6.1 us against 9.4 with str fields).
        key = result_key(request_id, self.result_prefix)
        self._entries.append((key, fields))
        self._keys[key] = last or self._keys.get(key, False)

    # ---- the round trip ---------------------------------------------------------------------
    def flush(self, riders: list[PipelineRider] = ()) -> int:
        """Send everything queued, and the riders' commands, in one pipeline; returns the number
        of result entries sent.

        Raises redis.ConnectionError / TimeoutError when Redis is unreachable, keeping the queue
        for the next flush; replies Redis refused are left in `last_errors`.
        """
        flush = self.send(riders)
        return 0 if flush is None else len(flush.entries)

    def send(self, riders: list[PipelineRider] = ()) -> ResultFlush | None:
        """`flush`, returning the ResultFlush that went out (its riders answered), or None when there was
        nothing to send."""
        flush = self.prepare(riders)
        if flush is None:
            return None
        try:
            flush.execute()
        except BaseException:
            self.requeue(flush)
            raise
        self.complete(flush)
        return flush

    def prepare(self, riders: list[PipelineRider] = ()) -> ResultFlush | None:
        """Take the queue out into a filled pipeline (no I/O); None when there is nothing to send."""
        flush = ResultFlush(self._entries, self._keys, self._finished_entry_ids, self._deleted_keys, list(riders))
        pipe = self.client.pipeline(transaction=False)
        for key, fields in flush.entries:
            pipe.xadd(key, fields)
        now = flush.prepared_at = time.monotonic()
        stale = now - self.refresh_seconds
        refreshed = self._refreshed
        flush.expired_keys = [key for key, last in flush.keys.items() if last or refreshed.get(key, stale) <= stale]
        for key in flush.expired_keys:
            pipe.expire(key, self.ttl_seconds)
        if flush.deleted_keys:
            pipe.delete(*flush.deleted_keys)
        if flush.finished_entry_ids:
            pipe.xack(self.request_stream, self.group, *flush.finished_entry_ids)
            pipe.xdel(self.request_stream, *flush.finished_entry_ids)
        flush.num_own = len(pipe)
        flush.rider_counts = [rider.queue(pipe) for rider in flush.riders]
        if len(pipe) == 0:
            return None  # the queue was empty: nothing was taken
        flush.pipe = pipe
        self._entries, self._keys, self._finished_entry_ids, self._deleted_keys = [], {}, [], []
        return flush

    def complete(self, flush: ResultFlush) -> int:
        """A flush that went through: count it, keep refused writes in `last_errors`, answer the
        riders; returns the number of result entries sent."""
        sent = len(flush.entries)
        self._note_refreshed(flush)
        self.num_flushes += 1
        self.num_entries_sent += sent
        self.last_flush_seconds = flush.seconds
        self.last_errors = [r for r in flush.replies[:flush.num_own] if isinstance(r, Exception)]
        start = flush.num_own
        for rider, n in zip(flush.riders, flush.rider_counts):
            rider.answer(flush.replies[start:start + n])
            start += n
        return sent

    def _note_refreshed(self, flush: ResultFlush) -> None:
        """The TTLs the flush refreshed (a stream whose last entry went out is forgotten), and
        now and then the streams not written for a TTL (a request another verifier took over)."""
        refreshed = self._refreshed
        for key in flush.expired_keys:
            if flush.keys[key]:
                refreshed.pop(key, None)
            else:
                refreshed[key] = flush.prepared_at
        for key in flush.deleted_keys:
            refreshed.pop(key, None)
        if flush.prepared_at - self._last_prune > self.ttl_seconds:
            self._last_prune = flush.prepared_at
            cutoff = flush.prepared_at - self.ttl_seconds
            self._refreshed = {k: t for k, t in refreshed.items() if t > cutoff}

    def requeue(self, flush: ResultFlush) -> None:
        """A flush that failed: its results go back in front of those queued since, in order."""
        self._entries = flush.entries + self._entries
        self._keys = {**flush.keys, **{k: last or flush.keys.get(k, False) for k, last in self._keys.items()}}
        self._finished_entry_ids = flush.finished_entry_ids + self._finished_entry_ids
        self._deleted_keys = flush.deleted_keys + self._deleted_keys


def _stats(s: SpecStats) -> bytes:
    """SpecStats as JSON without dataclasses.asdict's deep copy (once per request per step)."""
    return _JSON.encode({"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                         "num_accepted_tokens": s.num_accepted_tokens,
                         "accepted_per_position": s.accepted_per_position,
                         "num_zero_draft_steps": s.num_zero_draft_steps}).encode()


def _sid(entry_id) -> str:
    """Stream ids as text (redis-py hands back bytes unless decode_responses is set)."""
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def _tokens(token_ids: list[int]) -> bytes:
    return _JSON.encode(token_ids).encode()


def _logprobs(logprobs: list) -> bytes:
    """[[logprob, [[id, logprob], ...]] or null per token]: TokenLogprob is a tuple, so JSON as is
    (-inf as -Infinity, which Python's json reads back)."""
    return _JSON.encode(logprobs).encode()
