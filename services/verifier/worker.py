"""The verifier's loop: admit, step, emit, log — one engine, driven by one thread (the loop's),
and a writer thread that does nothing but the result round trips.

    admit  XREADGROUP as many requests as the batch has free slots (BLOCK ~100 ms only when the
           engine is idle) and hand them to the engine; bad entries, invalid prompts and requests
           past their deadline get an error result (services/verifier/admission.py).
    step   engine.step(): draft, verify, commit for the whole batch.
    emit   one pipelined Redis round trip a step (services/verifier/results/): first tokens as
           soon as a prefill samples them, a delta per request with new tokens, finals, XACK + XDEL,
           the cancellation poll (cancel.py) and, when due, the heartbeat (claims.py). While the
           engine has work left it runs on the writer thread, overlapping the next step.
    log    a periodic summary line; request-level events are logged where they happen.

Redis is touched at most twice an iteration, never once per request; every `scan_ms` a verifier
with room also reclaims entries idle past `--reclaim-idle-ms` (their verifier died) and resumes
them from their result streams. Requests leave the request stream only once answered, so XLEN is
the queue depth. Redis unreachable is never fatal: the loop backs off while idle, keeps computing
while busy, and queued results go out when Redis answers again.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from services.verifier.admission import Admission
from services.verifier.claims import Claims
from services.verifier.metrics import StepRecord, VerifierMetrics
from services.verifier.results.flush import ResultQueue
from services.verifier.results.pipeline import ResultPipeline
from services.verifier.results.writer import ResultWriter
from services.verifier.worker_types import (DEADLINE_EXCEEDED, INTERNAL_ERROR, ActiveRequest, ErrorAnswers, RedisHealth,
                                            WorkerConfig, WorkerSnapshot)
from specd.engine.engine import SpecEngine
from specd.engine.sequence import Sequence
from specd.messages import SpecStats
from specd.step_trace import StepTracer, TraceWindow

log = logging.getLogger("specd.verifier")


class VerifierWorker:
    """Drives one SpecEngine from a Redis request stream to per-request result streams: the loop
    holds the admission (services/verifier/admission.py) and the result pipeline
    (services/verifier/results/), which share the running requests (`active`) and Redis's health."""

    def __init__(self, engine: SpecEngine, client: redis.Redis, config: WorkerConfig,
                 metrics: VerifierMetrics | None = None, clock=time.time) -> None:
        self.engine = engine
        self.client = client
        self.config = config
        self.metrics = metrics or VerifierMetrics()
        self.clock = clock
        self.result_queue = ResultQueue(client, config.request_stream, config.group, config.result_prefix,
                                        config.result_ttl_seconds)
        self.writer = ResultWriter(self.result_queue)
        self.claims = Claims(client, config.request_stream, config.group, config.consumer, config.claims,
                             config.result_prefix)
        self.active: dict[int, ActiveRequest] = {}  # engine seq id -> request
        request_ids: set[str] = set()  # of `active`: a second entry for one is dropped
        self._stop = threading.Event()
        self.redis_health = RedisHealth(self._stop)
        self.reject = ErrorAnswers(self.result_queue, self.metrics)
        self.admission = Admission(engine, client, config, self.claims, self.result_queue, self.writer, self.reject,
                                   self.redis_health, self.active, request_ids, self.metrics, clock)
        self.results = ResultPipeline(engine, config, self.claims, self.result_queue, self.writer, self.admission,
                                      self.redis_health, self.active, request_ids, self.metrics, clock)
        self._request_ids = request_ids
        self.other_seconds = 0.0
        self.exit_when_drained = False
        self.on_drain = None  # callable run once when a drain begins (health -> NOT_SERVING)
        self._started = time.monotonic()
        self._last_log = time.monotonic()
        self._last_logged = (0, 0)  # (steps, errors) at the last summary line
        if config.async_emit and config.early_first_token:
            engine.on_admitted = self.results.emit_first_tokens
        window = TraceWindow.from_settings()  # SPECD_TRACE_STEPS: a profiler trace of some steps (diagnosis)
        self.tracer = StepTracer(window, getattr(engine.runner, "device", None)) if window is not None else None

    # the worker's figures (admin API, logs, tests)
    draining = property(lambda self: self.admission.draining)
    num_reclaimed = property(lambda self: self.admission.num_reclaimed)
    num_errors = property(lambda self: self.reject.num_errors)
    num_finished = property(lambda self: self.results.num_finished)
    num_cancelled = property(lambda self: self.results.num_cancelled)
    num_lost = property(lambda self: self.results.num_lost)

    # ---- lifecycle --------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until stopped, or until drained when asked to exit then."""
        log.info("verifier serving", extra={"consumer": self.config.consumer,
                                            "stream": self.config.request_stream})
        try:
            while not self.is_done():
                self.run_once()
        finally:
            self.finish_writes()
            if self.tracer is not None:
                self.tracer.close()
        log.info("verifier stopped", extra={"consumer": self.config.consumer,
                                            "num_finished": self.num_finished})

    def run_once(self) -> StepRecord:
        """One iteration: admit, step, emit, log."""
        record = StepRecord()
        idle = not self.engine.has_unfinished()
        t0 = time.perf_counter()
        record.num_admitted = self.admission.admit()
        if idle:  # the read blocked until work came: idle time, not the loop's own (rest)
            t0 = time.perf_counter()
        if self.engine.has_unfinished():
            finished = self.step(record)
        else:
            finished = []
            if self.draining and not self.writer.has_pending:
                self._stop.wait(self.config.block_ms / 1000)  # drained: nothing to read, nothing to do
        self.expire_deadlines()
        self.results.emit(finished, record)
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
        self.admission.draining = True
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
                and not self.writer.has_pending)

    def finish_writes(self) -> None:
        """The flush in flight lands (and is answered) before the worker reports it stopped."""
        try:
            self.results.collect(self.writer.wait, StepRecord())
        finally:
            self.writer.close()

    def ensure_group(self) -> None:
        """XGROUP CREATE ... MKSTREAM from the stream's start; an existing group is fine."""
        self.admission.ensure_group()

    # ---- step -------------------------------------------------------------------------------
    def step(self, record: StepRecord) -> list[Sequence]:
        """One engine step over the whole batch; fills the record's timings."""
        stats = self.engine.stats
        before, tokens0 = stats.timings.copy(), stats.num_output_tokens
        prefills0, eager0 = stats.num_prefills, stats.num_eager_prefills
        prefill_tokens0, hits0 = stats.num_prefill_tokens, stats.num_prefix_hit_tokens
        lengths0, undrafted0 = list(stats.draft_length_counts), stats.num_undrafted_steps
        t0 = time.perf_counter()
        self.results.record = record
        if self.tracer is not None:
            self.tracer.started()
        try:
            finished = self.engine.step()
        except Exception:
            self._fail_all("engine step failed; see the verifier's log")
            raise
        if self.tracer is not None:
            self.tracer.done()
        record.engine_seconds = time.perf_counter() - t0
        step = stats.timings.since(before)
        record.draft_seconds = step.draft
        record.verify_seconds = step.verify
        record.launch_seconds = step.launch
        record.device_wait_seconds = step.device_wait
        record.device_launch_seconds = step.device_launch
        record.device_forward_seconds = step.device_forward
        record.device_step_seconds = step.device_step
        record.launch_mark_seconds = step.launch_mark_host
        if step.num_forward_staged:  # (one verify forward a step at most)
            record.forward_kind, record.forward_own_seconds = "staged", step.forward_staged
        elif step.num_forward_unstaged:
            record.forward_kind, record.forward_own_seconds = "unstaged", step.forward_unstaged
        record.commit_seconds = step.commit - step.device_wait
        record.send_ahead_seconds, record.stage_seconds = step.send_ahead, step.stage
        record.prefill_seconds = step.prefill
        record.num_prefills = stats.num_prefills - prefills0
        record.num_eager_prefills = stats.num_eager_prefills - eager0
        record.num_prefill_tokens = stats.num_prefill_tokens - prefill_tokens0
        record.num_prefix_hit_tokens = stats.num_prefix_hit_tokens - hits0
        record.num_new_tokens = self.engine.stats.num_output_tokens - tokens0
        record.draft_lengths = [c - (lengths0[k] if k < len(lengths0) else 0)
                                for k, c in enumerate(stats.draft_length_counts)]
        record.undrafted = stats.num_undrafted_steps - undrafted0
        proposer = self.engine.proposer  # remote drafters: where the round trip went
        if getattr(proposer, "num_round_trips", 0):
            self.metrics.observe_round_trip(proposer.num_round_trips, proposer.last_round_trip)
        static = getattr(self.engine.runner, "static", None)  # the CUDA-graph path, where the runner has one
        if static is not None:
            self.metrics.observe_captures(static.num_captures, static.capture_seconds, static.num_capture_failures)
        return finished

    def _fail_all(self, message: str) -> None:
        """The engine is broken: answer every request it held with an error before the process exits.

        Re-raising afterwards (instead of leaving the entries pending for another verifier) keeps
        one poisonous request from taking down every verifier in turn.
        """
        log.exception("engine failure: failing all active requests", extra={"num_active": len(self.active)})
        for ar in list(self.active.values()):
            self.reject(ar.entry_id, ar.request_id, INTERNAL_ERROR, message, ar.num_emitted)
        self.active.clear()
        try:
            self.writer.wait()  # the step before goes out first (or back in front of the queue)
        except Exception:
            log.exception("could not write the previous step's results")
        try:
            self.result_queue.flush()
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
                self.reject(ar.entry_id, ar.request_id, DEADLINE_EXCEEDED,
                            f"deadline exceeded after {ar.seq.num_output_tokens} tokens", ar.num_emitted)

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
            "mean_draft_length": round(self.engine.stats.mean_draft_length, 2),
            "last_step_ms": round(record.total_seconds * 1000, 3),
            "last_emit_ms": round(record.emit_seconds * 1000, 3)})

    def snapshot(self) -> WorkerSnapshot:
        """Figures for the admin API (safe to call from another thread)."""
        stats = self.engine.stats
        with self.results.lock:
            spec = SpecStats()
            spec.merge(self.results.finished_spec)
        return WorkerSnapshot(
            consumer=self.config.consumer, num_running=len(self.engine.running),
            num_waiting=len(self.engine.waiting), num_finished=self.num_finished, num_errors=self.num_errors,
            num_steps=stats.num_steps, num_output_tokens=stats.num_output_tokens, spec_stats=spec,
            draft_seconds=stats.timings.draft, verify_seconds=stats.timings.verify,
            other_seconds=self.other_seconds, draining=self.draining,
            uptime_seconds=time.monotonic() - self._started)
