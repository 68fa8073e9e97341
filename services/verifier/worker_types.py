"""The verifier worker's data: its config, the requests it runs, the figures it reports, the
error codes it answers with and how it answers them, and its view of Redis's health (kept apart
from services/verifier/worker.py, which is the loop)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from services.verifier.claims import ClaimConfig
from specd import settings
from specd.engine.sequence import Sequence
from specd.messages import ConfigError, SpecStats
from specd.transport.redis_streams import (CANCEL_PREFIX, CONSUMER_GROUP, DEFAULT_REQUEST_STREAM, RESULT_PREFIX,
                                           RESULT_TTL_SECONDS)

log = logging.getLogger("specd.verifier")

# Error codes written to result streams (HTTP-like, the gateway maps them to its protocols).
BAD_REQUEST = 400
CLIENT_CLOSED = 499  # cancelled by the client (nginx's code; the gateway counts it the same)
INTERNAL_ERROR = 500
NOT_IMPLEMENTED = 501
SERVICE_UNAVAILABLE = 503  # a service the request needs is down (the grammar service, past its recovery)
DEADLINE_EXCEEDED = 504



@dataclass
class WorkerConfig:
    """Where the worker reads requests and writes results, and how it paces itself."""

    consumer: str
    request_stream: str = DEFAULT_REQUEST_STREAM
    group: str = CONSUMER_GROUP
    result_prefix: str = RESULT_PREFIX
    result_ttl_seconds: int = RESULT_TTL_SECONDS
    block_ms: int = 100  # XREADGROUP BLOCK while the engine is idle
    log_interval_s: float = 10.0  # summary line period; 0 disables
    claims: ClaimConfig = field(default_factory=ClaimConfig)  # heartbeats and reclaiming dead verifiers'
    cancel_prefix: str = CANCEL_PREFIX
    # Result round trips on a writer thread, overlapping the next engine step; False: the loop
    # waits for each one (services/verifier/results/writer.py says what changes: answers one step late).
    async_emit: bool = True
    # While the engine is busy, the read for free batch slots rides that result round trip instead
    # of a round trip of its own on the step's critical path (admission.py, ReadRider); its entries
    # are admitted when the flush is collected, a step later. SPECD_VERIFIER_RIDE_READS=0: off.
    ride_reads: bool = field(default_factory=settings.VERIFIER_RIDE_READS.get)
    # With async_emit, the first tokens of the requests a step prefills leave on a flush of their
    # own before the step drafts and verifies (worker.emit_first_tokens): time to first token is
    # the prefill's, not the prefill's and a step's. SPECD_VERIFIER_EARLY_FIRST_TOKEN=0: off (A/B).
    early_first_token: bool = field(default_factory=settings.VERIFIER_EARLY_FIRST_TOKEN.get)

    def __post_init__(self) -> None:
        if not self.consumer:
            raise ConfigError("consumer: must be a non-empty name")
        if self.block_ms < 1:
            raise ConfigError(f"block_ms: must be >= 1, got {self.block_ms}")
        if self.result_ttl_seconds < 1:
            raise ConfigError(f"result_ttl_seconds: must be >= 1, got {self.result_ttl_seconds}")


@dataclass(slots=True)
class ActiveRequest:
    """A request inside the engine: its stream entry, its sequence and what was sent of it."""

    request_id: str
    entry_id: bytes | str  # in the request stream; XACK + XDEL when answered
    seq: Sequence
    deadline: float | None  # unix time
    arrival_time: float  # unix time the gateway queued it
    admitted_at: float  # unix time this verifier read it
    num_emitted: int = 0  # output tokens already queued as deltas
    spec_seen: SpecStats = field(default_factory=SpecStats)  # speculation already counted in metrics


@dataclass
class WorkerSnapshot:
    """Live figures for the admin Stats RPC."""

    consumer: str
    num_running: int
    num_waiting: int
    num_finished: int
    num_errors: int
    num_steps: int
    num_output_tokens: int
    spec_stats: SpecStats
    draft_seconds: float
    verify_seconds: float
    other_seconds: float
    draining: bool
    uptime_seconds: float



def sid(entry_id) -> str:
    """Stream ids as text (redis-py hands back bytes unless decode_responses is set)."""
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


class ErrorAnswers:
    """Answers a request with an error result and takes its entry off the stream (both sent with
    the next flush of `result_queue`); counts them (`num_errors`)."""

    def __init__(self, result_queue, metrics) -> None:
        self.result_queue, self.metrics = result_queue, metrics
        self.num_errors = 0

    def __call__(self, entry_id, request_id: str | None, code: int, message: str, pos: int = 0) -> None:
        if request_id is not None:
            self.result_queue.error(request_id, code, message, pos)
        self.result_queue.finish_entry(entry_id)
        self.num_errors += 1
        self.metrics.observe_error(code)
        log.warning("request failed", extra={"request_id": request_id, "code": code, "reason": message})


class RedisHealth:
    """Redis unreachable is never fatal: `failed` logs (not every time) and, while idle, backs off
    (until `stop` is set); `ok` after any round trip that went through."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self.failures = 0  # in a row

    def ok(self) -> None:
        self.failures = 0

    def failed(self, verb: str, error: Exception, idle: bool) -> None:
        self.failures += 1
        if self.failures in (1, 10) or self.failures % 100 == 0:
            log.error("redis unavailable", extra={"verb": verb, "failures": self.failures, "error": str(error)})
        if idle:
            self._stop.wait(min(1.0, 0.05 * self.failures))
