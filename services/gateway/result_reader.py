"""The gateway's one background reader of result streams.

The reader XREADs every active result stream in one call (BLOCK ~50 ms) and dispatches entries to
per-request asyncio queues. The XREAD runs on a connection of its own, so that a request which
subscribes (or is cancelled) while a read blocks can cut that read short with CLIENT UNBLOCK from
the pool, and joins the next read at once: without it a new request's first tokens waited up to a
block (50-100 ms: Redis times blocked reads out on its 10 Hz cron) for a read that did not name its
stream, whenever the active streams were quiet (a long prefill, requests queued behind a full
batch). Positions make delivery exactly-once: tokens below what a request has already received
are dropped, so duplicate deltas (a verifier that resumed a request, a retried write) never reach
the client. Cancelling a request (client gone) sets its cancel key, which the
verifier running it looks up every step (services/verifier/cancel.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.exceptions

from services.gateway.errors import REDIS_ERRORS
from specd.transport.redis_streams import (CANCEL_PREFIX, RESULT_PREFIX, RESULT_TTL_SECONDS, ResultEntry,
                                           cancel_key, result_key)

logger = logging.getLogger(__name__)


@dataclass
class _Subscription:
    key: str
    queue: asyncio.Queue  # of ResultEntry, deduplicated
    last_id: str = "0-0"  # stream id already read; 0 so that nothing written before joining is missed
    num_delivered: int = 0  # output tokens handed to the queue (positions below are duplicates)
    keep: bool = False  # the stream outlives this reader (Idempotency-Key: a retry may read it again)


class ResultReader:
    """XREADs all active result streams in one call per iteration and dispatches their entries.

    New requests join on the next iteration, which they start (CLIENT UNBLOCK). After a request's
    final (or error) entry its result key is deleted; keys of abandoned requests are deleted too and
    would otherwise expire (TTL).
    """

    def __init__(self, client, *, prefix: str = RESULT_PREFIX, block_ms: int = 50,
                 max_keys_per_call: int = 256, redis_grace_s: float = 2.0,
                 cancel_prefix: str = CANCEL_PREFIX, cancel_ttl_s: int = RESULT_TTL_SECONDS,
                 cut_reads_short: bool = True) -> None:
        self.client = client
        self.prefix = prefix
        self.cancel_prefix = cancel_prefix
        self.cancel_ttl_s = cancel_ttl_s  # as long as a request can wait in the queue and still run
        self.block_ms = block_ms
        self.max_keys_per_call = max_keys_per_call
        self.redis_grace_s = redis_grace_s  # how long Redis may fail before waiting requests fail
        self._subs: dict[str, _Subscription] = {}
        self._to_delete: list[str] = []
        self._to_cancel: list[str] = []  # cancel keys to set
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._rotation = 0
        self.cut_reads_short = cut_reads_short  # False: a new stream waits for the read in flight (bench)
        self._reader = None  # a single-connection client of client's pool: the XREADs' connection
        self._reader_id: int | None = None  # its CLIENT ID; None until asked, again after a reconnect
        self._read_gen = 0  # counts XREADs; a read in flight is number _read_gen
        self._reading = False
        self._unblocking: asyncio.Task | None = None

    @property
    def num_active(self) -> int:
        return len(self._subs)

    def subscribe(self, request_id: str, keep: bool = False) -> asyncio.Queue:
        """The queue of a request's result entries, from the stream's start. keep: leave the stream
        to its TTL when done (a retry with the same Idempotency-Key reads it again)."""
        key = result_key(request_id, self.prefix)
        sub = self._subs[key] = _Subscription(key, asyncio.Queue(), keep=keep)
        self._wakeup.set()
        self._cut_read_short()
        return sub.queue

    def unsubscribe(self, request_id: str, *, delete: bool = True) -> None:
        key = result_key(request_id, self.prefix)
        sub = self._subs.pop(key, None)
        if sub is not None and delete and not sub.keep:
            self._to_delete.append(key)
            self._wakeup.set()

    def cancel(self, request_id: str) -> None:
        """Stop reading a request and tell its verifier to abort it (sent by the reader's loop)."""
        self.unsubscribe(request_id)
        self._to_cancel.append(cancel_key(request_id, self.cancel_prefix))
        self._wakeup.set()
        self._cut_read_short()  # the verifier learns of it a read sooner, and frees the batch slot

    def _cut_read_short(self) -> None:
        """End the XREAD in flight (if any), so the next one starts now with the new state."""
        if (self.cut_reads_short and self._reading and self._unblocking is None
                and self._reader_id is not None):
            self._unblocking = asyncio.create_task(self._unblock(self._read_gen, self._reader_id))

    async def _unblock(self, gen: int, reader_id: int) -> None:
        try:
            for _ in range(3):
                if not (self._reading and self._read_gen == gen):
                    return  # that read ended by itself; the next one names every stream
                if await self.client.client_unblock(reader_id):
                    return
                # Not blocked (yet): the XREAD is still on its way to the server.
                await asyncio.sleep(0.002)
        except REDIS_ERRORS:
            pass  # the read ends by its timeout, as it would have without us
        except redis.exceptions.ResponseError as e:
            self._give_up_cutting(e)
        finally:
            self._unblocking = None

    def start(self) -> None:
        if self._task is None:
            self._reader = self.client.client()
            self._task = asyncio.create_task(self._run(), name="specd-result-reader")

    async def stop(self) -> None:
        # The flag as well as the cancel: redis-py may turn a CancelledError that lands inside a
        # command into a connection error, which the loop would survive and then wait forever.
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._unblocking is not None:
            self._unblocking.cancel()
        await self._delete_finished()
        if self._reader is not None:
            if self._reader.connection is not None:
                self._reader.connection.deregister_connect_callback(self._on_reader_connect)
            await self._reader.aclose()  # its connection back to the pool
            self._reader = None

    async def _run(self) -> None:
        failing_since: float | None = None
        while not self._stopping:
            if not self._subs and not self._to_delete and not self._to_cancel:
                self._wakeup.clear()
                await self._wakeup.wait()
            try:
                await self._delete_finished()
                if self._subs:
                    await self._read_once()
                failing_since = None
            except REDIS_ERRORS as e:
                self._reader_id = None  # a reconnect gives the connection another id
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= self.redis_grace_s:
                    self._fail_all(503, f"lost the connection to Redis: {e}")
                    failing_since = None
                await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad entry stop every request's results
                logger.exception("result reader iteration failed")
                await asyncio.sleep(0.1)

    async def _read_once(self) -> None:
        keys = list(self._subs)
        if len(keys) > self.max_keys_per_call:  # rotate so that every stream gets read
            start = self._rotation % len(keys)
            keys = (keys[start:] + keys[:start])[:self.max_keys_per_call]
            self._rotation += self.max_keys_per_call
        if self.cut_reads_short and self._reader_id is None:
            await self._learn_reader_id()
        self._read_gen += 1
        self._reading = True
        try:
            reply = await self._reader.xread({k: self._subs[k].last_id for k in keys}, block=self.block_ms)
        finally:
            self._reading = False
        for key, entries in reply or []:
            key = key.decode() if isinstance(key, bytes) else key
            for entry_id, fields in entries:
                sub = self._subs.get(key)
                if sub is None:  # finished or abandoned while we read
                    break
                sub.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._dispatch(sub, ResultEntry.from_fields(fields, delta_stats=False))  # finals' stats only

    async def _learn_reader_id(self) -> None:
        await self._reader.initialize()
        self._reader.connection.register_connect_callback(self._on_reader_connect)
        try:
            self._reader_id = await self._reader.client_id()
        except redis.exceptions.ResponseError as e:  # an ACL (or a managed Redis) refusing CLIENT
            self._give_up_cutting(e)

    def _give_up_cutting(self, error: Exception) -> None:
        logger.warning("result reader: Redis refused a CLIENT command (%s); new requests join the next "
                       "read instead of cutting the one in flight short (up to %d ms later)", error, self.block_ms)
        self.cut_reads_short = False

    def _on_reader_connect(self, connection) -> None:
        """redis-py reconnected the read connection (inside a command's retry, say): its old id may
        name another client now, so none is used until the next read asks again."""
        self._reader_id = None

    def _dispatch(self, sub: _Subscription, entry: ResultEntry) -> None:
        if entry.kind in ("delta", "final"):
            skip = sub.num_delivered - entry.pos
            if skip < 0:
                logger.error("%s: tokens from %d missing (next entry at %d)", sub.key, sub.num_delivered, entry.pos)
                entry = ResultEntry(kind="error", code=502,
                                    message=f"result stream gap: expected position {sub.num_delivered}, "
                                            f"got {entry.pos}")
            else:
                entry.tokens = entry.tokens[skip:]
                if entry.logprobs is not None:
                    entry.logprobs = entry.logprobs[skip:]
                entry.pos = sub.num_delivered
                sub.num_delivered += len(entry.tokens)
                if entry.kind == "delta" and not entry.tokens:
                    return  # a pure duplicate
        elif entry.kind != "error":
            logger.warning("%s: unknown result entry kind %r", sub.key, entry.kind)
            return
        sub.queue.put_nowait(entry)
        if entry.kind != "delta":
            del self._subs[sub.key]
            if not sub.keep:
                self._to_delete.append(sub.key)

    async def _delete_finished(self) -> None:
        """Finished requests' result streams deleted, cancelled ones' cancel keys set: one round trip."""
        if not self._to_delete and not self._to_cancel:
            return
        keys, self._to_delete = self._to_delete, []
        cancels, self._to_cancel = self._to_cancel, []
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                if keys:
                    pipe.delete(*keys)
                for key in cancels:
                    pipe.set(key, 1, ex=self.cancel_ttl_s)
                await pipe.execute()
        except REDIS_ERRORS:
            logger.warning("could not delete %d finished result streams (they expire) nor set %d cancel "
                           "keys (those requests run to the end)", len(keys), len(cancels))

    def _fail_all(self, code: int, message: str) -> None:
        logger.error("%s; failing %d waiting requests", message, len(self._subs))
        for sub in self._subs.values():
            sub.queue.put_nowait(ResultEntry(kind="error", code=code, message=message))
        self._subs.clear()
