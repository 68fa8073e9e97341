"""The verifier loop's emit verb: a step's deltas, finals and the riders' answers.

For every request with tokens committed since the last emit, one delta (with its pos); for
finished requests the final entry, then XACK + XDEL of their stream entries: one pipelined Redis
round trip per step (services/verifier/results/flush.py), carrying the cancellation poll
(services/verifier/cancel.py), the heartbeat when due (services/verifier/claims.py) and, while
busy, the request read (admission.py ReadRider). While the engine has work left the round trip
runs on the writer thread, overlapping the next step (services/verifier/results/writer.py); the
loop waits for it, and applies what its riders learned, when it hands over the next. A request's first token
does not wait for the step's end: it leaves on a flush of its own as soon as its prefill sampled
it (emit_first_tokens).
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from services.verifier.admission import Admission, ReadRider
from services.verifier.cancel import CancelPoll
from services.verifier.claims import Claims, HeartbeatRider
from services.verifier.results.flush import ResultFlush, ResultQueue
from services.verifier.metrics import StepRecord, add_spec_difference
from services.verifier.worker_types import (CLIENT_CLOSED, SERVICE_UNAVAILABLE, ActiveRequest, RedisHealth, WorkerConfig,
                                            sid)
from services.verifier.results.writer import ResultWriter
from specd.engine.sequence import Sequence
from specd.messages import SpecStats

log = logging.getLogger("specd.verifier")


class ResultPipeline:
    """The emit verb of VerifierWorker (services/verifier/worker.py): writes the worker's `active`
    requests' results through `result_queue` and `writer`, drops the requests its riders' answers end
    (shared with the admission, whose request read it carries), and counts what it answered.
    `record` is the step under way (emit_first_tokens adds to it)."""

    def __init__(self, engine, config: WorkerConfig, claims: Claims, result_queue: ResultQueue, writer: ResultWriter,
                 admission: Admission, redis_health: RedisHealth, active: dict[int, ActiveRequest],
                 request_ids: set[str], metrics, clock) -> None:
        self.engine, self.config, self.claims = engine, config, claims
        self.result_queue, self.writer = result_queue, writer
        self.admission, self.redis_health, self.metrics, self.clock = admission, redis_health, metrics, clock
        self.active, self._request_ids = active, request_ids
        self.record: StepRecord | None = None
        self.num_finished = 0
        self.num_cancelled = 0  # requests the client gave up on
        self.num_lost = 0  # requests another verifier reclaimed from us (we had stalled)
        self.finished_spec = SpecStats()  # totals over finished requests
        self.lock = threading.Lock()  # guards finished_spec for snapshot readers

    def emit(self, finished: list[Sequence], record: StepRecord) -> None:
        """Queue the step's deltas and finals and send them in one round trip: in the background
        while the engine has a next step to overlap it with (config.async_emit), else right away.

        The previous step's flush is waited for first and its riders' answers applied, so with
        async_emit a cancellation or a lost entry seen by step n's pipeline takes effect after
        step n+1 (one step late): that step's tokens for the request are dropped, not written.
        """
        t0 = time.perf_counter()
        for ar in self.active.values():  # before answers drop any: the step ran for all of them
            add_spec_difference(record.spec, ar.seq.stats, ar.spec_seen)
        self.collect(self.writer.wait, record)
        for ar in self.active.values():
            seq = ar.seq
            n = len(seq.output_token_ids)
            if n > ar.num_emitted and not seq.is_finished:
                self.result_queue.delta(ar.request_id, ar.num_emitted, seq.output_token_ids[ar.num_emitted:n],
                                        seq.stats, _logprobs(seq, ar.num_emitted, n))
                ar.num_emitted = n
        for seq in finished:
            ar = self.active.pop(seq.seq_id, None)
            if ar is not None:  # None: cancelled or lost by the answers of the step before
                self._finish(ar)
                record.num_finished += 1
        riders = self._riders()
        if self.config.async_emit and self.engine.has_unfinished():
            read = self.admission.read_rider()  # the next admit's read, on this round trip
            started = self.writer.start(riders + [read] if read is not None else riders)
            self.admission.read_riding = started and read is not None  # answered by the next emit's wait
        else:
            self.collect(lambda: self.writer.flush(riders), record)
        record.emit_seconds = time.perf_counter() - t0

    def emit_first_tokens(self, seqs: list[Sequence]) -> None:
        """The engine just prefilled seqs (engine.on_admitted, with async_emit): their first tokens
        go out now, on a flush of their own started before the step drafts and verifies, so a
        request's first token waits for its prefill only, not for a whole step more. The flush in
        flight (the last step's) is waited for first and its riders applied, as at a step's end:
        the engine is between its admit and its batch, where cancelling or adding requests is safe."""
        self.collect(self.writer.wait, self.record or StepRecord())
        queued = False
        for seq in seqs:
            ar = self.active.get(seq.seq_id)
            n = len(seq.output_token_ids)
            if ar is not None and not seq.is_finished and n > ar.num_emitted:
                self.result_queue.delta(ar.request_id, ar.num_emitted, seq.output_token_ids[ar.num_emitted:n],
                                        seq.stats, _logprobs(seq, ar.num_emitted, n))
                ar.num_emitted = n
                queued = True
        if queued:
            self.writer.start()

    def _riders(self) -> list:
        """The step's pipeline riders: the heartbeat when due, then the cancellation poll."""
        if not self.active:
            return []
        riders = []
        now = time.monotonic()
        if self.claims.heartbeat_due(now):
            riders.append(self.claims.heartbeat([ar.entry_id for ar in self.active.values()], now))
        riders.append(CancelPoll([ar.request_id for ar in self.active.values()], self.config.cancel_prefix))
        return riders

    def collect(self, send, record: StepRecord) -> None:
        """Run or wait for a flush (`send`), then apply what its riders learned, on this thread
        (the engine's): Redis unreachable is handled here, the queue was kept for the next flush."""
        t0 = time.perf_counter()
        admission = self.admission
        riding, admission.read_riding = admission.read_riding, False  # the flush in flight, if any, is taken now
        try:
            flush: ResultFlush | None = send()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            admission.reread_own = admission.reread_own or riding  # its read may have taken entries: find them
            self.redis_health.failed("emit", e, idle=not self.engine.has_unfinished())
            return
        finally:
            record.emit_wait_seconds += time.perf_counter() - t0
        if flush is None:
            return
        self.redis_health.ok()
        record.flush_seconds += flush.seconds
        # The heartbeat first: an entry another verifier took over is dropped, never acknowledged
        # as cancelled (XACK does not check the consumer).
        for rider in flush.riders:
            if isinstance(rider, HeartbeatRider) and rider.answered:
                self.claims.heartbeat_sent(rider.sent_at)
                self._drop_lost(rider.lost)
            elif isinstance(rider, CancelPoll) and rider.cancelled:
                self._cancel(rider.cancelled)
            elif isinstance(rider, ReadRider):
                record.num_admitted += admission.admit_ridden(rider)
        for e in self.result_queue.last_errors:
            log.error("redis refused a result write: %s", e)
        self.result_queue.last_errors = []

    def _drop_lost(self, entry_ids: list) -> None:
        """Entries another verifier reclaimed while we stalled: theirs now, stop running them."""
        lost = {sid(e) for e in entry_ids}
        for seq_id, ar in list(self.active.items()):
            if sid(ar.entry_id) in lost:
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
            self.result_queue.finish_entry(ar.entry_id)
            self.result_queue.discard(ar.request_id)
            self.num_cancelled += 1
            self.metrics.observe_error(CLIENT_CLOSED)
            log.info("cancelled by the client", extra={"request_id": ar.request_id,
                                                       "output_tokens": ar.seq.num_output_tokens})

    def _finish(self, ar: ActiveRequest) -> None:
        seq = ar.seq
        if seq.finish_reason == "error":  # the engine could not go on with it (its grammar was lost)
            self.admission.reject(ar.entry_id, ar.request_id, SERVICE_UNAVAILABLE, seq.error or "failed",
                                  ar.num_emitted)
            self._request_ids.discard(ar.request_id)
            return
        self.result_queue.final(ar.request_id, ar.num_emitted, seq.output_token_ids[ar.num_emitted:],
                                seq.finish_reason, seq.stats, len(seq.prompt_token_ids),
                                _logprobs(seq, ar.num_emitted, len(seq.output_token_ids)),
                                cached_tokens=seq.num_cached_tokens)
        self.result_queue.finish_entry(ar.entry_id)
        ar.num_emitted = len(seq.output_token_ids)
        self._request_ids.discard(ar.request_id)
        self.num_finished += 1
        with self.lock:
            self.finished_spec.merge(seq.stats)
        self.metrics.observe_finished(seq.finish_reason)
        log.info("finished", extra={
            "request_id": ar.request_id, "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.prompt_token_ids), "output_tokens": seq.num_output_tokens,
            "acceptance_rate": round(seq.stats.acceptance_rate, 3),
            "mean_acceptance_length": round(seq.stats.mean_acceptance_length, 3),
            "latency_s": round(self.clock() - ar.arrival_time, 4)})


def _logprobs(seq: Sequence, start: int, end: int) -> list | None:
    """The logprobs of output tokens start..end-1 where the request asked, else None (no field)."""
    return seq.output_logprobs[start:end] if seq.params.logprobs is not None else None
