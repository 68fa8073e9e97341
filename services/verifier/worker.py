"""The verifier's loop: admit, step, emit, log — one engine, one Redis connection, one thread.

    admit  XREADGROUP as many requests as the batch has free slots (BLOCK ~100 ms only when the
           engine is idle), decode them, hand them to the engine; bad entries, invalid prompts and
           requests past their deadline are answered with an error result instead.
    step   engine.step(): draft, verify, commit for the whole batch (synchronous torch work).
    emit   for every request with tokens committed since the last emit, one delta (with its pos);
           for finished requests the final entry; then XACK + XDEL of their stream entries — all
           in one pipelined Redis round trip per step (services/verifier/emitter.py), which also
           carries the cancellation poll (services/verifier/cancel.py) and, when due, the
           heartbeat of the running requests' entries (services/verifier/claims.py).
    log    a periodic summary line; request-level events are logged where they happen.

Redis is touched at most twice per iteration (the read, when the batch has room, and the result
pipeline), never once per request; every `scan_ms` a verifier with room also looks for entries
idle past `--reclaim-idle-ms` (their verifier died) and resumes them from their result streams.
Engine sequence ids map to request ids through `active`. Requests leave the request stream only
once answered, so XLEN is the queue depth. Redis unreachable is never fatal: the loop backs off
while idle, keeps computing while busy, and queued results go out when Redis answers again.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass, field

import redis

from services.verifier.cancel import CancelPoll
from services.verifier.claims import ClaimConfig, ClaimedEntry, Claims
from services.verifier.emitter import ResultEmitter
from services.verifier.metrics import StepRecord, VerifierMetrics, add_spec_difference
from specd.engine.engine import SpecEngine
from specd.engine.sequence import Sequence
from specd.grammar.response_format import parse_response_format
from specd.messages import ConfigError, SpecStats
from specd.transport.redis_streams import (CANCEL_PREFIX, CONSUMER_GROUP, DEFAULT_REQUEST_STREAM, RESULT_PREFIX,
                                           RESULT_TTL_SECONDS, QueuedRequest)
from specd.transport.resume import ResumePoint

log = logging.getLogger("specd.verifier")

# Error codes written to result streams (HTTP-like, the gateway maps them to its protocols).
BAD_REQUEST = 400
CLIENT_CLOSED = 499  # cancelled by the client (nginx's code; the gateway counts it the same)
INTERNAL_ERROR = 500
NOT_IMPLEMENTED = 501
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


class VerifierWorker:
    """Drives one SpecEngine from a Redis request stream to per-request result streams."""

    def __init__(self, engine: SpecEngine, client: redis.Redis, config: WorkerConfig,
                 metrics: VerifierMetrics | None = None, clock=time.time) -> None:
        self.engine = engine
        self.client = client
        self.config = config
        self.metrics = metrics or VerifierMetrics()
        self.clock = clock
        self.emitter = ResultEmitter(client, config.request_stream, config.group, config.result_prefix,
                                     config.result_ttl_seconds)
        self.claims = Claims(client, config.request_stream, config.group, config.consumer, config.claims,
                             config.result_prefix)
        self.active: dict[int, ActiveRequest] = {}  # engine seq id -> request
        self._request_ids: set[str] = set()
        self.num_finished = 0
        self.num_errors = 0
        self.num_reclaimed = 0  # requests resumed from a dead verifier
        self.num_cancelled = 0  # requests the client gave up on
        self.num_lost = 0  # requests another verifier reclaimed from us (we had stalled)
        self.other_seconds = 0.0
        self.finished_spec = SpecStats()  # totals over finished requests
        self.draining = False
        self.exit_when_drained = False
        self.on_drain = None  # callable run once when a drain begins (health -> NOT_SERVING)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards finished_spec for snapshot readers
        self._started = time.monotonic()
        self._last_log = time.monotonic()
        self._last_logged = (0, 0)  # (steps, errors) at the last summary line
        self._redis_failures = 0
        self._group_ready = False

    # ---- lifecycle --------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until stopped, or until drained when asked to exit then."""
        log.info("verifier serving", extra={"consumer": self.config.consumer,
                                            "stream": self.config.request_stream})
        while not self.is_done():
            self.run_once()
        log.info("verifier stopped", extra={"consumer": self.config.consumer,
                                            "num_finished": self.num_finished})

    def run_once(self) -> StepRecord:
        """One iteration: admit, step, emit, log."""
        t0 = time.perf_counter()
        record = StepRecord()
        record.num_admitted = self.admit()
        if self.engine.has_unfinished():
            finished = self.step(record)
        else:
            finished = []
            if self.draining and not self.emitter.has_pending:
                self._stop.wait(self.config.block_ms / 1000)  # drained: nothing to read, nothing to do
        self.expire_deadlines()
        self.emit(finished, record)
        record.total_seconds = time.perf_counter() - t0
        record.num_running, record.num_waiting = len(self.engine.running), len(self.engine.waiting)
        if record.engine_seconds > 0:
            self.other_seconds += record.other_seconds
        self.metrics.observe_step(record)
        self.log(record)
        return record

    def drain(self, exit_when_drained: bool = False) -> tuple[int, int]:
        """Stop admitting; the running requests finish. Returns (num_running, num_waiting)."""
        first = not self.draining
        self.draining = True
        self.exit_when_drained = self.exit_when_drained or exit_when_drained
        if first:
            log.info("draining", extra={"num_running": len(self.engine.running),
                                        "num_waiting": len(self.engine.waiting),
                                        "exit_when_drained": self.exit_when_drained})
            if self.on_drain is not None:
                self.on_drain()
        return len(self.engine.running), len(self.engine.waiting)

    def stop(self) -> None:
        """Leave the loop after the current iteration, drained or not (unanswered entries stay pending)."""
        self._stop.set()

    def is_done(self) -> bool:
        if self._stop.is_set():
            return True
        return (self.draining and self.exit_when_drained and not self.active
                and not self.emitter.has_pending)

    def ensure_group(self) -> None:
        """XGROUP CREATE ... MKSTREAM from the stream's start; an existing group is fine."""
        try:
            self.client.xgroup_create(self.config.request_stream, self.config.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    # ---- admit ------------------------------------------------------------------------------
    def admit(self) -> int:
        """Read up to the batch's free slots from the request stream; returns how many were admitted."""
        if self.draining:
            return 0
        free = self.engine.max_batch_size - len(self.engine.running) - len(self.engine.waiting)
        if free <= 0:
            return 0
        idle = not self.engine.has_unfinished() and not self.emitter.has_pending
        admitted = 0
        now = self.clock()
        try:
            if not self._group_ready:
                self.ensure_group()
            if self.claims.scan_due(time.monotonic()):  # the oldest requests first
                for claimed in self.claims.reclaim(free, time.monotonic()):
                    admitted += self._admit_claimed(claimed, now)
                free = self.engine.max_batch_size - len(self.engine.running) - len(self.engine.waiting)
                if free <= 0:
                    self._redis_failures = 0
                    return admitted
                idle = idle and not admitted and not self.emitter.has_pending
            reply = self.client.xreadgroup(self.config.group, self.config.consumer,
                                           {self.config.request_stream: ">"}, count=free,
                                           block=self.config.block_ms if idle else None)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._group_ready = False  # the stream was deleted under us: create it again next time
            return admitted
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._on_redis_error("admit", e, idle)
            return admitted
        self._redis_failures = 0
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                admitted += self._admit_entry(entry_id, fields or {}, now)
        return admitted

    def _admit_claimed(self, claimed: ClaimedEntry, now: float) -> int:
        """An entry taken over from a verifier that stopped heartbeating: resume, ack or fail it."""
        entry_id, fields, resume = claimed.entry_id, claimed.fields, claimed.resume
        if fields is None:  # deleted while pending: it was answered, only the XACK was lost
            self.emitter.finish_entry(entry_id)
            return 0
        raw_id = fields.get(b"id", fields.get("id"))
        request_id = raw_id.decode(errors="replace") if isinstance(raw_id, bytes) else raw_id
        mine = next((ar for ar in self.active.values() if ar.request_id == request_id), None)
        if mine is not None:  # our own, stale after a long stall: it stays ours
            if _sid(mine.entry_id) != _sid(entry_id):
                self.emitter.finish_entry(entry_id)  # a second entry for the request: the first answers
            return 0
        if resume is not None and resume.is_answered:
            self.emitter.finish_entry(entry_id)
            return 0
        if resume is None:
            self._reject(entry_id, request_id, INTERNAL_ERROR,
                         "the request's result stream has a gap; it cannot be resumed")
            return 0
        if claimed.num_deliveries > self.config.claims.max_deliveries:
            self._reject(entry_id, request_id, INTERNAL_ERROR,
                         f"the request was claimed {claimed.num_deliveries} times: its verifiers keep "
                         "dying on it", resume.num_output_tokens)
            return 0
        log.warning("reclaimed a request from a dead verifier", extra={
            "request_id": request_id, "resume_at": resume.num_output_tokens,
            "deliveries": claimed.num_deliveries})
        admitted = self._admit_entry(entry_id, fields, now, resume)
        self.num_reclaimed += admitted
        return admitted

    def _admit_entry(self, entry_id, fields: dict, now: float, resume: ResumePoint | None = None) -> int:
        """Decode one entry and add it to the engine, or answer it with an error; never raises.

        With `resume` (a reclaimed entry) the request continues after the tokens already written.
        """
        try:
            request = QueuedRequest.from_fields(fields)
            deadline = None if request.deadline is None else float(request.deadline)
        except Exception as e:  # any malformed entry: a bad body must not stop the verifier
            raw_id = fields.get(b"id", fields.get("id"))
            request_id = raw_id.decode(errors="replace") if isinstance(raw_id, bytes) else raw_id
            self._reject(entry_id, request_id or None, BAD_REQUEST,
                         f"malformed request entry: {type(e).__name__}: {e}")
            return 0
        if request.request_id in self._request_ids:  # delivered twice: the first copy answers
            log.warning("duplicate request entry dropped", extra={"request_id": request.request_id})
            self.emitter.finish_entry(entry_id)
            return 0
        if deadline is not None and deadline <= now:
            self._reject(entry_id, request.request_id, DEADLINE_EXCEEDED,
                         "deadline exceeded before the request was admitted")
            return 0
        try:
            grammar = parse_response_format(request.response_format)
            if grammar is not None and self.engine.constraints.backend is None:
                self._reject(entry_id, request.request_id, NOT_IMPLEMENTED,
                             "response_format: this verifier runs without a grammar backend")
                return 0
            seq = self.engine.add_request(
                request.prompt_token_ids, request.params, grammar,
                output_token_ids=resume.output_token_ids if resume else None,
                spec_stats=resume.spec_stats if resume else None)
        except ConfigError as e:
            self._reject(entry_id, request.request_id, BAD_REQUEST, str(e), resume.num_output_tokens if resume else 0)
            return 0
        self.active[seq.seq_id] = ActiveRequest(request.request_id, entry_id, seq, deadline,
                                                request.arrival_time, now,
                                                num_emitted=seq.num_output_tokens,
                                                spec_seen=copy.deepcopy(seq.stats))
        self._request_ids.add(request.request_id)
        self.metrics.observe_admitted(len(request.prompt_token_ids))
        log.debug("admitted", extra={"request_id": request.request_id, "seq_id": seq.seq_id,
                                     "prompt_tokens": len(request.prompt_token_ids),
                                     "queued_s": round(now - request.arrival_time, 4)})
        return 1

    def _reject(self, entry_id, request_id: str | None, code: int, message: str, pos: int = 0) -> None:
        """Answer a request with an error result and take its entry off the stream (next flush)."""
        if request_id is not None:
            self.emitter.error(request_id, code, message, pos)
        self.emitter.finish_entry(entry_id)
        self.num_errors += 1
        self.metrics.observe_error(code)
        log.warning("request failed", extra={"request_id": request_id, "code": code, "reason": message})

    # ---- step -------------------------------------------------------------------------------
    def step(self, record: StepRecord) -> list[Sequence]:
        """One engine step over the whole batch; fills the record's timings."""
        timings = self.engine.stats.timings
        draft0, verify0, tokens0 = timings.draft, timings.verify, self.engine.stats.num_output_tokens
        t0 = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception:
            self._fail_all("engine step failed; see the verifier's log")
            raise
        record.engine_seconds = time.perf_counter() - t0
        record.draft_seconds = timings.draft - draft0
        record.verify_seconds = timings.verify - verify0
        record.num_new_tokens = self.engine.stats.num_output_tokens - tokens0
        return finished

    def _fail_all(self, message: str) -> None:
        """The engine is broken: answer every request it held with an error before the process exits.

        Re-raising afterwards (instead of leaving the entries pending for another verifier) keeps
        one poisonous request from taking down every verifier in turn.
        """
        log.exception("engine failure: failing all active requests", extra={"num_active": len(self.active)})
        for ar in list(self.active.values()):
            self._reject(ar.entry_id, ar.request_id, INTERNAL_ERROR, message, ar.num_emitted)
        self.active.clear()
        try:
            self.emitter.flush()
        except redis.RedisError:
            log.exception("could not write the error results")

    def expire_deadlines(self) -> None:
        """Abort running requests whose deadline passed (frees their cache) and answer them 504."""
        now = None
        for seq_id, ar in list(self.active.items()):
            if ar.deadline is None or ar.seq.is_finished:
                continue
            now = now if now is not None else self.clock()
            if ar.deadline <= now:
                self.engine.abort(ar.seq, reason="deadline")
                del self.active[seq_id]
                self._request_ids.discard(ar.request_id)
                self._reject(ar.entry_id, ar.request_id, DEADLINE_EXCEEDED,
                             f"deadline exceeded after {ar.seq.num_output_tokens} tokens", ar.num_emitted)

    # ---- emit -------------------------------------------------------------------------------
    def emit(self, finished: list[Sequence], record: StepRecord) -> None:
        """Queue the step's deltas and finals, then send them in one round trip."""
        t0 = time.perf_counter()
        spec = record.spec
        for ar in self.active.values():
            seq = ar.seq
            add_spec_difference(spec, seq.stats, ar.spec_seen)
            n = len(seq.output_token_ids)
            if n > ar.num_emitted and not seq.is_finished:
                self.emitter.delta(ar.request_id, ar.num_emitted, seq.output_token_ids[ar.num_emitted:n],
                                   seq.stats)
                ar.num_emitted = n
        for seq in finished:
            self._finish(self.active.pop(seq.seq_id))
        record.num_finished = len(finished)
        riders, cancel, heartbeat = [], None, None
        if self.active:
            cancel = CancelPoll([ar.request_id for ar in self.active.values()], self.config.cancel_prefix)
            riders.append(cancel)
            beat_at = time.monotonic()
            if self.claims.heartbeat_due(beat_at):
                heartbeat = self.claims.heartbeat([ar.entry_id for ar in self.active.values()])
                riders.append(heartbeat)
        try:
            self.emitter.flush(riders)
            self._redis_failures = 0
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._on_redis_error("emit", e, idle=not self.engine.has_unfinished())
        if heartbeat is not None and heartbeat.answered:
            self.claims.heartbeat_sent(beat_at)
            self._drop_lost(heartbeat.lost)
        if cancel is not None and cancel.cancelled:
            self._cancel(cancel.cancelled)
        for e in self.emitter.last_errors:
            log.error("redis refused a result write: %s", e)
        self.emitter.last_errors = []
        record.emit_seconds = time.perf_counter() - t0

    def _drop_lost(self, entry_ids: list) -> None:
        """Entries another verifier reclaimed while we stalled: theirs now, stop running them."""
        lost = {_sid(e) for e in entry_ids}
        for seq_id, ar in list(self.active.items()):
            if _sid(ar.entry_id) in lost:
                self.engine.abort(ar.seq, reason="reclaimed")
                del self.active[seq_id]
                self._request_ids.discard(ar.request_id)
                self.num_lost += 1
                log.warning("request reclaimed by another verifier; dropped here",
                            extra={"request_id": ar.request_id, "output_tokens": ar.seq.num_output_tokens})

    def _cancel(self, request_ids: list[str]) -> None:
        """The client went away: abort (frees the KV blocks), acknowledge, delete the results."""
        cancelled = set(request_ids)
        for seq_id, ar in list(self.active.items()):
            if ar.request_id not in cancelled:
                continue
            self.engine.abort(ar.seq, reason="cancelled")
            del self.active[seq_id]
            self._request_ids.discard(ar.request_id)
            self.emitter.finish_entry(ar.entry_id)
            self.emitter.discard(ar.request_id)
            self.num_cancelled += 1
            self.metrics.observe_error(CLIENT_CLOSED)
            log.info("cancelled by the client", extra={"request_id": ar.request_id,
                                                      "output_tokens": ar.seq.num_output_tokens})

    def _finish(self, ar: ActiveRequest) -> None:
        seq = ar.seq
        self.emitter.final(ar.request_id, ar.num_emitted, seq.output_token_ids[ar.num_emitted:],
                           seq.finish_reason, seq.stats, len(seq.prompt_token_ids))
        self.emitter.finish_entry(ar.entry_id)
        ar.num_emitted = len(seq.output_token_ids)
        self._request_ids.discard(ar.request_id)
        self.num_finished += 1
        with self._lock:
            self.finished_spec.merge(seq.stats)
        self.metrics.observe_finished(seq.finish_reason)
        log.info("finished", extra={
            "request_id": ar.request_id, "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.prompt_token_ids), "output_tokens": seq.num_output_tokens,
            "acceptance_rate": round(seq.stats.acceptance_rate, 3),
            "mean_acceptance_length": round(seq.stats.mean_acceptance_length, 3),
            "latency_s": round(self.clock() - ar.arrival_time, 4)})

    # ---- log --------------------------------------------------------------------------------
    def log(self, record: StepRecord) -> None:
        """A summary line every log_interval_s, skipped while idle."""
        interval = self.config.log_interval_s
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval:
            return
        self._last_log = now
        snap = self.snapshot()
        if (snap.num_steps, snap.num_errors) == self._last_logged:
            return  # idle since the last line
        self._last_logged = (snap.num_steps, snap.num_errors)
        log.info("stats", extra={
            "running": snap.num_running, "waiting": snap.num_waiting, "finished": snap.num_finished,
            "errors": snap.num_errors, "steps": snap.num_steps, "output_tokens": snap.num_output_tokens,
            "acceptance_rate": round(snap.spec_stats.acceptance_rate, 3),
            "last_step_ms": round(record.total_seconds * 1000, 3),
            "last_emit_ms": round(record.emit_seconds * 1000, 3)})

    def snapshot(self) -> WorkerSnapshot:
        """Figures for the admin API (safe to call from another thread)."""
        stats = self.engine.stats
        with self._lock:
            spec = SpecStats()
            spec.merge(self.finished_spec)
        return WorkerSnapshot(
            consumer=self.config.consumer, num_running=len(self.engine.running),
            num_waiting=len(self.engine.waiting), num_finished=self.num_finished, num_errors=self.num_errors,
            num_steps=stats.num_steps, num_output_tokens=stats.num_output_tokens, spec_stats=spec,
            draft_seconds=stats.timings.draft, verify_seconds=stats.timings.verify,
            other_seconds=self.other_seconds, draining=self.draining,
            uptime_seconds=time.monotonic() - self._started)

    # ---- errors -----------------------------------------------------------------------------
    def _on_redis_error(self, verb: str, error: Exception, idle: bool) -> None:
        """Redis unreachable: log (not every time), back off while idle; queued results are kept."""
        self._redis_failures += 1
        if self._redis_failures in (1, 10) or self._redis_failures % 100 == 0:
            log.error("redis unavailable", extra={"verb": verb, "failures": self._redis_failures,
                                                  "error": str(error)})
        if idle:
            self._stop.wait(min(1.0, 0.05 * self._redis_failures))


def _sid(entry_id) -> str:
    """Stream ids as text (redis-py hands back bytes unless decode_responses is set)."""
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
