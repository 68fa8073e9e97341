"""The verifier loop's admit verb: read entries from the request stream, decode them, hand them
to the engine, or answer them with an error; reclaim the entries of dead verifiers.

XREADGROUP asks for as many requests as the batch has free slots, with BLOCK (~100 ms) only when
the engine is idle and no results are waiting to be written, so a busy loop never sleeps here.
While the engine is busy the read rides the step's result pipeline instead (ReadRider, on the
writer thread, overlapping the next step: config.ride_reads), so a busy step spends no round trip
of its own on admission; what it read is admitted when the loop collects that flush, one step
later than a read of its own would (at batch 1 on an H200 that read was ~8% of an "off" step).
After a read that found requests the next one is the loop's
own again: a burst is admitted without a step's delay per wave.
Every `scan_ms` a verifier with room first looks for entries idle past `--reclaim-idle-ms` (their
verifier died) and resumes them from their result streams (services/verifier/claims.py).
"""

from __future__ import annotations

import copy
import logging
import time

import redis

from services.verifier.claims import ClaimedEntry, Claims
from services.verifier.results.flush import ResultQueue
from services.verifier.worker_types import (BAD_REQUEST, DEADLINE_EXCEEDED, INTERNAL_ERROR, NOT_IMPLEMENTED,
                                            ActiveRequest, ErrorAnswers, RedisHealth, WorkerConfig, sid)
from services.verifier.results.writer import ResultWriter
from specd.grammar.response_format import parse_response_format
from specd.messages import ConfigError
from specd.transport.redis_streams import QueuedRequest
from specd.transport.resume import ResumePoint

log = logging.getLogger("specd.verifier")


class ReadRider:
    """The busy loop's XREADGROUP for its free batch slots (no BLOCK), as a result-pipeline rider
    (services/verifier/results/flush.py PipelineRider)."""

    def __init__(self, stream: str, group: str, consumer: str, count: int) -> None:
        self.stream, self.group, self.consumer, self.count = stream, group, consumer, count
        self.reply: list | None = None  # filled by `answer`
        self.error: Exception | None = None

    def queue(self, pipe) -> int:
        pipe.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=self.count)
        return 1

    def answer(self, replies: list) -> None:
        if replies and isinstance(replies[0], Exception):
            self.error = replies[0]
        elif replies:
            self.reply = replies[0]


class Admission:
    """The admit verb of VerifierWorker (services/verifier/worker.py): reads into the engine and
    the worker's `active` / `request_ids` (shared with the result pipeline), answers bad entries
    through `reject`, and asks `writer` what is still being answered. `draining` stops it."""

    def __init__(self, engine, client: redis.Redis, config: WorkerConfig, claims: Claims, result_queue: ResultQueue,
                 writer: ResultWriter, reject: ErrorAnswers, redis_health: RedisHealth,
                 active: dict[int, ActiveRequest], request_ids: set[str], metrics, clock) -> None:
        self.engine, self.client, self.config, self.claims = engine, client, config, claims
        self.result_queue, self.writer, self.reject, self.redis_health = result_queue, writer, reject, redis_health
        self.active, self._request_ids, self.metrics, self.clock = active, request_ids, metrics, clock
        self.draining = False
        self.num_reclaimed = 0  # requests resumed from a dead verifier
        self._group_ready = False
        self.read_riding = False  # the in-flight result flush carries the request read
        self.reread_own = False  # a flush with a read failed: read this consumer's pending entries
        self._read_found = False  # the last request read found entries (no ride next)

    def ensure_group(self) -> None:
        """XGROUP CREATE ... MKSTREAM from the stream's start; an existing group is fine."""
        try:
            self.client.xgroup_create(self.config.request_stream, self.config.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    def admit(self) -> int:
        """Read up to the batch's free slots from the request stream; returns how many were admitted."""
        if self.draining:
            return 0
        free = self.engine.max_batch_size - len(self.engine.running) - len(self.engine.waiting)
        if free <= 0:
            return 0
        idle = not self.engine.has_unfinished() and not self.writer.has_pending
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
                    self.redis_health.ok()
                    return admitted
                idle = idle and not admitted and not self.writer.has_pending
            if self.reread_own:  # a ridden read's reply was lost: what it took is ours, pending
                own = self.client.xreadgroup(self.config.group, self.config.consumer,
                                             {self.config.request_stream: "0"})
                self.reread_own = False
                admitted += self._admit_reply(own, now, unanswered_only=True)
            if self.read_riding:  # this step's read is in the result flush in flight
                self.redis_health.ok()
                return admitted
            reply = self.client.xreadgroup(self.config.group, self.config.consumer,
                                           {self.config.request_stream: ">"}, count=free,
                                           block=self.config.block_ms if idle else None)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._group_ready = False  # the stream was deleted under us: create it again next time
            return admitted
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self.redis_health.failed("admit", e, idle)
            return admitted
        self.redis_health.ok()
        return admitted + self._admit_reply(reply, now)

    def read_rider(self) -> ReadRider | None:
        """The read for the step's result flush, when the batch has free slots (admit then skips
        its own read while that flush is in flight); None when draining or full."""
        if self.draining or not self.config.ride_reads or not self._group_ready or self._read_found:
            return None  # after a read that found requests, more may be arriving: read them at once
        free = self.engine.max_batch_size - len(self.engine.running) - len(self.engine.waiting)
        if free <= 0:
            return None
        return ReadRider(self.config.request_stream, self.config.group, self.config.consumer, free)

    def admit_ridden(self, rider: ReadRider) -> int:
        """What a collected ReadRider read. A refused read (the group gone: NOGROUP) makes the next
        admit create the group again. Entries read by a round trip whose reply was lost are
        pending under this consumer: the next admit reads this consumer's pending history
        (`reread_own`, set by the result pipeline) and admits those it is not running or answering."""
        if rider.error is not None:
            if "NOGROUP" in str(rider.error):
                self._group_ready = False
            else:
                log.error("redis refused the ridden request read: %s", rider.error)
            return 0
        return self._admit_reply(rider.reply, self.clock())

    def _admit_reply(self, reply, now: float, unanswered_only: bool = False) -> int:
        """Admit an XREADGROUP reply's entries; unanswered_only (this consumer's pending history):
        not those it runs or is answering. A read of new entries notes whether it found any (read_rider)."""
        if not unanswered_only:
            self._read_found = any(entries for _stream, entries in reply or [])
        admitted = 0
        running = {sid(ar.entry_id) for ar in self.active.values()} if unanswered_only else set()
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                if unanswered_only and (sid(entry_id) in running or self.writer.is_finishing(entry_id)):
                    continue
                admitted += self._admit_entry(entry_id, fields or {}, now)
        return admitted

    def _admit_claimed(self, claimed: ClaimedEntry, now: float) -> int:
        """An entry taken over from a verifier that stopped heartbeating: resume, ack or fail it."""
        entry_id, fields, resume = claimed.entry_id, claimed.fields, claimed.resume
        if self.writer.is_finishing(entry_id):
            # Answered here: its XACK is queued, or in flight on the writer thread while this scan
            # ran (a step longer than idle_ms left it idle); resuming it would answer it twice.
            return 0
        if fields is None:  # deleted while pending: it was answered, only the XACK was lost
            self.result_queue.finish_entry(entry_id)
            return 0
        raw_id = fields.get(b"id", fields.get("id"))
        request_id = raw_id.decode(errors="replace") if isinstance(raw_id, bytes) else raw_id
        mine = next((ar for ar in self.active.values() if ar.request_id == request_id), None)
        if mine is not None:  # our own, stale after a long stall: it stays ours
            if sid(mine.entry_id) != sid(entry_id):
                self.result_queue.finish_entry(entry_id)  # a second entry for the request: the first answers
            return 0
        if resume is not None and resume.is_answered:
            self.result_queue.finish_entry(entry_id)
            return 0
        if resume is None:
            self.reject(entry_id, request_id, INTERNAL_ERROR,
                         "the request's result stream has a gap; it cannot be resumed")
            return 0
        if claimed.num_deliveries > self.config.claims.max_deliveries:
            self.reject(entry_id, request_id, INTERNAL_ERROR,
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
            self.reject(entry_id, request_id or None, BAD_REQUEST,
                         f"malformed request entry: {type(e).__name__}: {e}")
            return 0
        if request.request_id in self._request_ids:  # delivered twice: the first copy answers
            log.warning("duplicate request entry dropped", extra={"request_id": request.request_id})
            self.result_queue.finish_entry(entry_id)
            return 0
        if deadline is not None and deadline <= now:
            self.reject(entry_id, request.request_id, DEADLINE_EXCEEDED,
                         "deadline exceeded before the request was admitted")
            return 0
        try:
            grammar = parse_response_format(request.response_format)
            if grammar is not None and self.engine.constraints.backend is None:
                self.reject(entry_id, request.request_id, NOT_IMPLEMENTED,
                             "response_format: this verifier runs without a grammar backend")
                return 0
            seq = self.engine.add_request(
                request.prompt_token_ids, request.params, grammar,
                output_token_ids=resume.output_token_ids if resume else None,
                spec_stats=resume.spec_stats if resume else None)
        except ConfigError as e:
            self.reject(entry_id, request.request_id, BAD_REQUEST, str(e), resume.num_output_tokens if resume else 0)
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
