"""Reading result streams: one background reader per gateway, per-request streams of text deltas.

The reader XREADs every active result stream in one call (BLOCK ~50 ms) and dispatches entries to
per-request asyncio queues. Positions make delivery exactly-once: tokens below what a request has
already received are dropped, so duplicate deltas (a verifier that resumed a request, a retried
write) never reach the client. A request's stream turns tokens into text incrementally and cuts it
before the first stop string. Cancelling a request (client gone) sets its cancel key, which the
verifier running it looks up every step (services/verifier/cancel.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.exceptions

from specd.messages import SpecStats
from specd.sampling_params import SamplingParams
from specd.transport.redis_streams import (CANCEL_PREFIX, RESULT_PREFIX, RESULT_TTL_SECONDS, ResultEntry,
                                           cancel_key, result_key)

logger = logging.getLogger(__name__)

REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error", 499: "cancelled", 503: "service_unavailable", 504: "timeout"}


class GatewayError(Exception):
    """A request failed with an HTTP-like status; the HTTP and gRPC front ends both map it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def to_body(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def redis_unavailable(error: Exception) -> GatewayError:
    return GatewayError(503, f"the request queue (Redis) is unreachable: {error}", code="redis_unavailable",
                        retry_after=1)


# ---- the reader ------------------------------------------------------------------------------
@dataclass
class _Subscription:
    key: str
    queue: asyncio.Queue  # of ResultEntry, deduplicated
    last_id: str = "0-0"  # stream id already read; 0 so that nothing written before joining is missed
    num_delivered: int = 0  # output tokens handed to the queue (positions below are duplicates)


class ResultReader:
    """XREADs all active result streams in one call per iteration and dispatches their entries.

    New requests join on the next iteration. After a request's final (or error) entry its result
    key is deleted; keys of abandoned requests are deleted too and would otherwise expire (TTL).
    """

    def __init__(self, client, *, prefix: str = RESULT_PREFIX, block_ms: int = 50,
                 max_keys_per_call: int = 256, redis_grace_s: float = 2.0,
                 cancel_prefix: str = CANCEL_PREFIX, cancel_ttl_s: int = RESULT_TTL_SECONDS) -> None:
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

    @property
    def num_active(self) -> int:
        return len(self._subs)

    def subscribe(self, request_id: str) -> asyncio.Queue:
        key = result_key(request_id, self.prefix)
        sub = self._subs[key] = _Subscription(key, asyncio.Queue())
        self._wakeup.set()
        return sub.queue

    def unsubscribe(self, request_id: str, *, delete: bool = True) -> None:
        key = result_key(request_id, self.prefix)
        if self._subs.pop(key, None) is not None and delete:
            self._to_delete.append(key)
            self._wakeup.set()

    def cancel(self, request_id: str) -> None:
        """Stop reading a request and tell its verifier to abort it (sent by the reader's loop)."""
        self.unsubscribe(request_id)
        self._to_cancel.append(cancel_key(request_id, self.cancel_prefix))
        self._wakeup.set()

    def start(self) -> None:
        if self._task is None:
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
        await self._delete_finished()

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
        reply = await self.client.xread({k: self._subs[k].last_id for k in keys}, block=self.block_ms)
        for key, entries in reply or []:
            key = key.decode() if isinstance(key, bytes) else key
            for entry_id, fields in entries:
                sub = self._subs.get(key)
                if sub is None:  # finished or abandoned while we read
                    break
                sub.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._dispatch(sub, ResultEntry.from_fields(fields))

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


# ---- tokens to text --------------------------------------------------------------------------
class IncrementalDetokenizer:
    """Text deltas from a growing token list.

    Each delta is the decoded text minus what was already sent, decoding a short window of recent
    tokens (the window's first tokens only give context, as in vLLM, so cost per delta does not grow
    with the output). A trailing U+FFFD is held back: it may be a UTF-8 sequence whose remaining
    bytes come with the next token. `finish` reconciles with one decode of all tokens.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # sent so far
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens whose text was sent

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            delta = full[len(self.text):]
        else:  # a tokenizer whose window decode drifted: keep what was sent, flush the window
            prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
            delta = self._decode(self.token_ids[self._prefix_offset:])[len(prefix_text):]
        self.text += delta
        return delta


class StopStringFilter:
    """Cuts text before the first stop string; holds back a tail that may begin one."""

    def __init__(self, stop_words: list[str], include_stop_str: bool = False) -> None:
        self.stop_words = [w for w in stop_words if w]
        self.include_stop_str = include_stop_str
        self.text = ""  # everything seen
        self.num_sent = 0
        self.is_stopped = False

    def push(self, delta: str, *, is_final: bool = False) -> str:
        if self.is_stopped:
            return ""
        self.text += delta
        if not self.stop_words:
            return self._send(len(self.text))
        longest = max(len(w) for w in self.stop_words)
        search_from = max(0, self.num_sent - longest + 1)
        hits = [(i, w) for w in self.stop_words if (i := self.text.find(w, search_from)) >= 0]
        if hits:
            index, word = min(hits)
            self.is_stopped = True
            return self._send(index + (len(word) if self.include_stop_str else 0))
        if is_final:
            return self._send(len(self.text))
        return self._send(len(self.text) - self._partial_stop_len())

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop word."""
        tail = self.text[self.num_sent:]
        for n in range(min(len(tail), max(len(w) for w in self.stop_words) - 1), 0, -1):
            if any(w.startswith(tail[-n:]) for w in self.stop_words):
                return n
        return 0

    def _send(self, end: int) -> str:
        out = self.text[self.num_sent:end] if end > self.num_sent else ""
        self.num_sent = max(self.num_sent, end)
        return out


# ---- one request -------------------------------------------------------------------------------
@dataclass
class GenerationOutput:
    """What one result entry adds for the client."""

    text: str  # new text
    token_ids: list[int]  # new tokens
    finish_reason: str | None = None  # set on the last output: "stop" | "length"
    spec_stats: SpecStats | None = None  # set on the last output


@dataclass
class GenerationResult:
    """A finished request, collected."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    spec_stats: SpecStats
    time_to_first_token: float
    latency: float


@dataclass
class RequestTimings:
    """Seconds from the gateway's receipt (perf_counter clock)."""

    received: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None

    @property
    def time_to_first_token(self) -> float:
        return (self.first_token or self.finished or time.perf_counter()) - self.received

    @property
    def latency(self) -> float:
        return (self.finished or time.perf_counter()) - self.received


class RequestStream:
    """The outputs of one submitted request, as an async iterator.

    Raises GatewayError for a verifier's error entry (with its code) or when the request's deadline
    passes (504). Leaving early (client disconnect, timeout) calls `on_abandon`, the hook where
    cancellation reaches the verifier.
    """

    def __init__(self, request_id: str, queue: asyncio.Queue, tokenizer, params: SamplingParams, *,
                 num_prompt_tokens: int, deadline: float, timings: RequestTimings,
                 on_finish: Callable[["RequestStream"], None],
                 on_abandon: Callable[[str, str], None]) -> None:
        self.request_id = request_id
        self.queue = queue
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.deadline = deadline  # perf_counter time
        self.timings = timings
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stop_filter = StopStringFilter(params.stop_words, params.include_stop_str_in_output)
        self.finish_reason: str | None = None
        self.spec_stats = SpecStats()
        self.is_done = False
        self._on_finish = on_finish
        self._on_abandon = on_abandon

    @property
    def token_ids(self) -> list[int]:
        return self.detokenizer.token_ids

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> GenerationOutput:
        if self.is_done:
            raise StopAsyncIteration
        entry = await self._next_entry()
        if entry.kind == "error":
            self.is_done = True
            self.timings.finished = time.perf_counter()
            raise GatewayError(entry.code or 500, entry.message or "the verifier failed the request",
                               code="verifier_error" if entry.code >= 500 else None)
        if entry.tokens and self.timings.first_token is None:
            self.timings.first_token = time.perf_counter()
        text = self.detokenizer.push(entry.tokens)
        if entry.kind == "delta":
            return GenerationOutput(self.stop_filter.push(text), entry.tokens)
        text += self.detokenizer.finish()
        text = self.stop_filter.push(text, is_final=True)
        self.finish_reason = "stop" if self.stop_filter.is_stopped else (entry.finish_reason or "stop")
        self.spec_stats = entry.spec_stats or SpecStats()
        self.is_done = True
        self.timings.finished = time.perf_counter()
        self._on_finish(self)
        return GenerationOutput(text, entry.tokens, self.finish_reason, self.spec_stats)

    async def _next_entry(self) -> ResultEntry:
        timeout = self.deadline - time.perf_counter()
        try:
            if timeout <= 0:
                raise TimeoutError
            return await asyncio.wait_for(self.queue.get(), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            self.is_done = True
            logger.warning("request %s timed out after %.1f s", self.request_id, self.timings.latency)
            self.abandon("timeout")
            raise GatewayError(504, f"request {self.request_id} timed out after "
                                    f"{self.timings.latency:.1f} s", code="timeout") from None

    def abandon(self, reason: str) -> None:
        """Stop reading (client gone, timeout); a no-op once the request has finished."""
        if self.timings.finished is None:
            self.is_done = True
            self.timings.finished = time.perf_counter()
            self._on_abandon(self.request_id, reason)

    async def collect(self) -> GenerationResult:
        """Read to the end."""
        parts = [out.text async for out in self]
        return GenerationResult(self.request_id, "".join(parts), list(self.token_ids),
                                self.finish_reason or "stop", self.num_prompt_tokens, self.spec_stats,
                                self.timings.time_to_first_token, self.timings.latency)
