"""One submitted request's outputs, as the front ends read them: text deltas cut before the first
stop string, the finish reason and spec stats at the end, timings, deadline and abandonment."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.detokenize import IncrementalDetokenizer, StopStringFilter
from services.gateway.errors import GatewayError
from services.gateway.logprob_release import LogprobRelease
from specd.messages import SpecStats
from specd.sampling_params import SamplingParams
from specd.transport.redis_streams import ResultEntry

logger = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    """What one result entry adds for the client."""

    text: str  # new text
    token_ids: list[int]  # new tokens
    finish_reason: str | None = None  # set on the last output: "stop" | "length"
    spec_stats: SpecStats | None = None  # set on the last output
    # Where the request asked: (token id, [logprob, [[id, logprob], ...]] or None) of the tokens
    # whose text this output carries (logprob_release.py), in order; None otherwise.
    logprobs: list[tuple[int, list | None]] | None = None


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
    logprobs: list[tuple[int, list | None]] | None = None  # as GenerationOutput's, for all tokens
    num_cached_tokens: int = 0  # prompt tokens the verifier found in its prefix cache


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
        self.logprob_release = LogprobRelease() if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.spec_stats = SpecStats()
        self.num_cached_tokens = 0  # from the final entry
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
        release = self.logprob_release
        if release is not None:
            release.add(entry.tokens, entry.logprobs)
        text = self.detokenizer.push(entry.tokens)
        if entry.kind == "delta":
            text = self.stop_filter.push(text)
            logprobs = release.take(len(self.detokenizer.text), self.stop_filter) if release is not None else None
            return GenerationOutput(text, entry.tokens, logprobs=logprobs)
        text += self.detokenizer.finish()
        text = self.stop_filter.push(text, is_final=True)
        logprobs = release.take(len(self.detokenizer.text), self.stop_filter, final=True) if release else None
        self.finish_reason = "stop" if self.stop_filter.is_stopped else (entry.finish_reason or "stop")
        self.spec_stats = entry.spec_stats or SpecStats()
        self.num_cached_tokens = entry.cached_tokens
        self.is_done = True
        self.timings.finished = time.perf_counter()
        self._on_finish(self)
        return GenerationOutput(text, entry.tokens, self.finish_reason, self.spec_stats, logprobs)

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
        parts, logprobs = [], [] if self.logprob_release is not None else None
        async for out in self:
            parts.append(out.text)
            if logprobs is not None:
                logprobs.extend(out.logprobs or [])
        return GenerationResult(self.request_id, "".join(parts), list(self.token_ids),
                                self.finish_reason or "stop", self.num_prompt_tokens, self.spec_stats,
                                self.timings.time_to_first_token, self.timings.latency, logprobs,
                                self.num_cached_tokens)
