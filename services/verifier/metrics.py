"""Prometheus figures of one verifier: lmdeploy's (and vLLM's) spec-decoding counters and more.

Terms as everywhere in specd: draft tokens are proposed, accepted ones kept; acceptance rate is
accepted / drafted; acceptance length is tokens emitted per verify step (accepted + 1).

The worker fills one StepRecord per loop iteration; `observe_step` turns it into counter and
histogram updates. Metrics live in their own registry (no global state) and are served by
prometheus_client's HTTP server when a port is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specd.messages import SpecStats
from specd.spec_metrics import SpecDecodeMetrics

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                0.1, 0.2, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class StepRecord:
    """What one iteration of the verifier loop did."""

    num_admitted: int = 0  # requests taken from the stream
    num_running: int = 0  # sequences in the batch after the step
    num_waiting: int = 0  # admitted, not yet prefilled
    num_new_tokens: int = 0  # tokens committed in the step (all requests)
    num_finished: int = 0  # requests that got their final entry
    draft_seconds: float = 0.0  # engine draft verb
    verify_seconds: float = 0.0  # engine verify verb (target forward + rejection sampling)
    launch_seconds: float = 0.0  # of verify: the host's work before the forward is queued
    device_wait_seconds: float = 0.0  # engine commit blocked on the device's results
    # The verify step on the device's clock from its start (specd/engine/device_clock.py): to the
    # forward's end, to the sampling's end; verify + device_wait less the latter: the host's wake-up.
    device_launch_seconds: float = 0.0
    device_forward_seconds: float = 0.0
    device_step_seconds: float = 0.0
    launch_mark_seconds: float = 0.0  # host seconds in the launch mark's record (a GIL wait shows here)
    forward_kind: str = ""  # "staged" / "unstaged": the verify forward's batch ("": none marked)
    forward_own_seconds: float = 0.0  # that forward on the device's clock, its launch to its end
    commit_seconds: float = 0.0  # engine commit verb (and sending drafts ahead), device wait excluded
    send_ahead_seconds: float = 0.0  # of commit: the next step's draft requests sent
    stage_seconds: float = 0.0  # of commit: the next verify batch staged
    prefill_seconds: float = 0.0  # of the engine's admit: the admitted requests' forward and first tokens
    num_prefills: int = 0  # admission forwards in the step (0 or 1)
    num_eager_prefills: int = 0  # of them, outside the runner's static path (CUDA graphs)
    num_prefill_tokens: int = 0  # prompt tokens the step's prefill computed
    num_prefix_hit_tokens: int = 0  # prompt tokens it found in the prefix cache instead
    engine_seconds: float = 0.0  # the whole engine step
    emit_seconds: float = 0.0  # the loop's emit verb: queueing, and waiting on Redis (below)
    emit_wait_seconds: float = 0.0  # of emit_seconds, blocked on result flushes: the round trip when
    #                                 synchronous, waiting for the writer thread when async
    flush_seconds: float = 0.0  # the round trip of the flush that completed in this iteration (on
    #                             the writer thread when async: overlapped with the engine step)
    total_seconds: float = 0.0  # the whole iteration: admit + step + emit
    spec: SpecStats = field(default_factory=SpecStats)  # speculation within this step
    # The draft lengths the engine chose in this step: draft_lengths[k] sequences drafted k
    # (draft_policy.py); undrafted: 1 when every sequence had k = 0 (nothing paid, or no budget left).
    draft_lengths: list[int] = field(default_factory=list)
    undrafted: int = 0

    @property
    def other_seconds(self) -> float:
        """Everything on the iteration's critical path but draft and verify (admit, commit, Redis)."""
        return max(0.0, self.total_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def rest_seconds(self) -> float:
        """other_seconds less the device wait, commit, emit and prefill: the stream read of new
        requests, deadlines, the loop itself."""
        return max(0.0, self.other_seconds - self.device_wait_seconds - self.commit_seconds
                   - self.emit_seconds - self.prefill_seconds)


def add_spec_difference(total: SpecStats, current: SpecStats, seen: SpecStats) -> None:
    """total += current - seen, then seen = current (per-request stats -> per-step deltas)."""
    if current.num_drafts == seen.num_drafts:
        return  # no verify step with drafts since last time: nothing changed
    total.num_drafts += current.num_drafts - seen.num_drafts
    total.num_draft_tokens += current.num_draft_tokens - seen.num_draft_tokens
    total.num_accepted_tokens += current.num_accepted_tokens - seen.num_accepted_tokens
    cur, old = current.accepted_per_position, seen.accepted_per_position
    if len(total.accepted_per_position) < len(cur):
        total.accepted_per_position.extend([0] * (len(cur) - len(total.accepted_per_position)))
    for i, v in enumerate(cur):
        total.accepted_per_position[i] += v - (old[i] if i < len(old) else 0)
    seen.num_drafts, seen.num_draft_tokens = current.num_drafts, current.num_draft_tokens
    seen.num_accepted_tokens, seen.accepted_per_position = current.num_accepted_tokens, list(cur)


class VerifierMetrics:
    """The verifier's Prometheus collectors, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.spec = SpecDecodeMetrics(r)
        self.num_running = Gauge("specd:num_requests_running", "Sequences in the batch", registry=r)
        self.num_waiting = Gauge("specd:num_requests_waiting", "Admitted requests not yet prefilled",
                                 registry=r)
        self.step_seconds = Histogram("specd:step_duration_seconds",
                                      "Seconds per loop iteration, by phase: draft, verify (of it "
                                      "launch: until the forward is queued), other (everything "
                                      "else), and other split into device_wait (the commit's wait "
                                      "for the device), commit, emit, prefill (of admitted requests) "
                                      "and rest; and on the device's clock from the verify step's "
                                      "start: device_launch (to the forward's first device work), "
                                      "device_forward (to the forward's end), device_step (to the "
                                      "sampling's end); launch_mark: the host's seconds in the "
                                      "launch mark (another thread's GIL turn right before the "
                                      "forward's launch); of commit: send_ahead (the next step's "
                                      "draft requests sent) and stage (the next verify batch staged)",
                                      ["phase"], buckets=STEP_BUCKETS, registry=r)
        self.verify_forward_seconds = Histogram(
            "specd:verify_forward_device_seconds", "The verify forward's own time on the device's "
            "clock (its launch to its end), by whether its batch was staged while its drafts were out",
            ["batch"], buckets=STEP_BUCKETS, registry=r)
        self.emit_seconds = Histogram("specd:emit_duration_seconds",
                                      "Seconds per step the loop spent writing results (queueing and "
                                      "waiting on Redis; the round trip itself only when synchronous)",
                                      buckets=STEP_BUCKETS, registry=r)
        self.emit_wait_seconds = Histogram("specd:emit_wait_duration_seconds",
                                           "Seconds per step the loop was blocked on result flushes",
                                           buckets=STEP_BUCKETS, registry=r)
        self.flush_seconds = Histogram("specd:result_flush_duration_seconds",
                                       "Seconds per result pipeline round trip (on the writer thread "
                                       "when async)", buckets=STEP_BUCKETS, registry=r)
        self.output_tokens = Counter("specd:generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("specd:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.requests_finished = Counter("specd:request_success", "Requests finished, by finish reason",
                                         ["finished_reason"], registry=r)
        self.request_errors = Counter("specd:request_errors", "Requests answered with an error, by code",
                                      ["code"], registry=r)
        self.graph_captures = Counter("specd:cuda_graph_captures", "CUDA graphs the target runner "
                                      "captured (each stalls the loop: ~0.3-0.5 s at 8B)", registry=r)
        self.graph_capture_seconds = Counter("specd:cuda_graph_capture_seconds",
                                             "Seconds the target runner spent capturing CUDA graphs",
                                             registry=r)
        self.graph_capture_failures = Counter(
            "specd:cuda_graph_capture_failures", "Layouts the target runner left without a CUDA graph: "
            "its capture ran out of memory, the layout runs slower (lower cache_max_entry_count)", registry=r)
        self.drafter_round_trip = Histogram(
            "specd:drafter_round_trip_seconds", "Seconds of each draft round trip with the remote "
            "drafters, by part: queued (until gRPC's sender thread took the request), transit (to the "
            "answer's arrival, less handle), handle (the drafter's own time; propose: its proposer's "
            "call inside it), waited (the engine "
            "blocked collecting it); and the send on the engine thread: to_host (hidden rows to the "
            "host), encode (messages built), write (serialised and handed off)", ["part"], buckets=STEP_BUCKETS, registry=r)
        self.draft_lengths = Counter("specd:spec_decode_draft_length", "Sequence-steps by the draft "
                                     "length chosen for them (k, 0 to --speculative-num-draft-tokens: "
                                     "adaptive drafting's choice, or the maximum when it is off)",
                                     ["k"], registry=r)
        self.undrafted_steps = Counter("specd:spec_decode_undrafted_steps", "Steps in which no sequence "
                                       "drafted (adaptive drafting found that nothing paid, or no budget "
                                       "was left)", registry=r)
        self.prefills = Counter("specd:prefill_forwards", "Admission forwards (each prefills the "
                                "requests admitted together), by path: static (CUDA graphs) or eager",
                                ["path"], registry=r)
        self.prompt_token_sources = Counter("specd:prefill_prompt_tokens", "Prompt tokens admitted, by "
                                            "where their K/V came from: prefill (computed) or "
                                            "prefix_cache (reused)", ["source"], registry=r)
        self._round_trips_seen = 0
        self._captures_seen = (0, 0.0, 0)
        self._phases = {p: self.step_seconds.labels(phase=p)
                        for p in ("draft", "verify", "launch", "other", "device_wait", "commit", "emit",
                                  "prefill", "rest", "device_launch", "device_forward", "device_step",
                                  "launch_mark", "send_ahead", "stage")}

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Serve /metrics over HTTP (a daemon thread); returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)

    def observe_step(self, record: StepRecord) -> None:
        self.num_running.set(record.num_running)
        self.num_waiting.set(record.num_waiting)
        if record.num_new_tokens:
            self.output_tokens.inc(record.num_new_tokens)
        if record.engine_seconds > 0:
            self._phases["draft"].observe(record.draft_seconds)
            self._phases["verify"].observe(record.verify_seconds)
            self._phases["launch"].observe(record.launch_seconds)
            self._phases["other"].observe(record.other_seconds)
            self._phases["device_wait"].observe(record.device_wait_seconds)
            self._phases["commit"].observe(record.commit_seconds)
            self._phases["send_ahead"].observe(record.send_ahead_seconds)
            self._phases["stage"].observe(record.stage_seconds)
            self._phases["emit"].observe(record.emit_seconds)
            self._phases["prefill"].observe(record.prefill_seconds)
            self._phases["rest"].observe(record.rest_seconds)
            self._phases["device_launch"].observe(record.device_launch_seconds)
            self._phases["device_forward"].observe(record.device_forward_seconds)
            self._phases["device_step"].observe(record.device_step_seconds)
            self._phases["launch_mark"].observe(record.launch_mark_seconds)
            self.emit_seconds.observe(record.emit_seconds)
            self.emit_wait_seconds.observe(record.emit_wait_seconds)
        if record.forward_kind:
            self.verify_forward_seconds.labels(batch=record.forward_kind).observe(record.forward_own_seconds)
        if record.num_prefills:
            self.prefills.labels(path="eager").inc(record.num_eager_prefills)
            self.prefills.labels(path="static").inc(record.num_prefills - record.num_eager_prefills)
        if record.num_prefill_tokens or record.num_prefix_hit_tokens:
            self.prompt_token_sources.labels(source="prefill").inc(record.num_prefill_tokens)
            self.prompt_token_sources.labels(source="prefix_cache").inc(record.num_prefix_hit_tokens)
        if record.flush_seconds > 0:
            self.flush_seconds.observe(record.flush_seconds)
        self.spec.observe(record.spec)
        for k, count in enumerate(record.draft_lengths):
            if count:
                self.draft_lengths.labels(k=str(k)).inc(count)
        if record.undrafted:
            self.undrafted_steps.inc(record.undrafted)

    def observe_round_trip(self, num_round_trips: int, last) -> None:
        """The proposer's last round trip (specd/clients/drafter.py DraftRoundTrip), when it is a new one."""
        if num_round_trips > self._round_trips_seen and last is not None:
            for part in ("queued", "transit", "handle", "propose", "waited", "to_host", "encode", "write"):
                self.drafter_round_trip.labels(part=part).observe(getattr(last, part))
        self._round_trips_seen = num_round_trips

    def observe_captures(self, num_captures: int, capture_seconds: float, num_failures: int = 0) -> None:
        """The runner's running totals (StaticForward.num_captures / capture_seconds /
        num_capture_failures)."""
        count, seconds, failures = self._captures_seen
        if num_captures > count:
            self.graph_captures.inc(num_captures - count)
            self.graph_capture_seconds.inc(max(0.0, capture_seconds - seconds))
        if num_failures > failures:
            self.graph_capture_failures.inc(num_failures - failures)
        self._captures_seen = (max(count, num_captures), max(seconds, capture_seconds), max(failures, num_failures))

    def observe_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_finished(self, finish_reason: str | None) -> None:
        self.requests_finished.labels(finished_reason=finish_reason or "unknown").inc()

    def observe_error(self, code: int) -> None:
        self.request_errors.labels(code=str(code)).inc()
