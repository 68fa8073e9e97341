"""DrafterServicer: the Drafter gRPC service over any Proposer of the core library.

Thin by design: each DraftStepRequest becomes close / open / one `proposer.propose` over the whole
list, and the DraftProposals become one DraftStepResponse. What the servicer adds is what a shared
network service needs:
  - sequence ids are scoped per stream: (stream, seq_id) maps to an internal unique id, so two
    verifiers may both use seq 0; a stream that ends (the verifier finished or died) closes all
    of its sequences;
  - one lock serialises model access across streams (sync gRPC gives each stream a thread);
  - every step is validated before the model sees it, and errors are mapped to status codes in
    one place (`_status_of`): the stream ends with INVALID_ARGUMENT / FAILED_PRECONDITION and a
    readable message, the server keeps serving the other streams.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch
from google.protobuf.message import DecodeError
from torch.profiler import record_function

from services.common.step_streams import StepError, invalid, serve_steps
from specd.grammar.backend import GrammarSpec
from specd.messages import ConfigError
from specd.proposers.base import DraftRequest, Proposer
from specd.sampling_params import SamplingParams
from specd.step_trace import StepTracer
from specd.transport.tensor_codec import TensorCodecError, tensor_from_buffer, tensor_from_pb, tensor_to_pb
from specd.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

logger = logging.getLogger(__name__)

HIDDEN_KIND_TO_PB = {"none": drafter_pb2.HIDDEN_KIND_NONE, "final": drafter_pb2.HIDDEN_KIND_FINAL,
                     "aux": drafter_pb2.HIDDEN_KIND_AUX}


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place where errors become gRPC statuses."""
    if isinstance(exc, StepError):
        return exc.code, str(exc)
    if isinstance(exc, (ConfigError, TensorCodecError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, DecodeError):  # the fast socket path parses requests itself (fast_steps.py)
        return grpc.StatusCode.INVALID_ARGUMENT, f"not a DraftStepRequest: {exc}"
    if isinstance(exc, (ValueError, KeyError)):  # the proposer refused this sequence's state
        return grpc.StatusCode.FAILED_PRECONDITION, f"proposer: {exc}"
    return grpc.StatusCode.INTERNAL, f"drafter internal error: {type(exc).__name__}: {exc}"


def sampling_params_from_pb(pb: common_pb2.SamplingParameters) -> SamplingParams:
    """The drafting-relevant sampling parameters; proto3 zeros of top_p and the repetition penalty
    mean "unset" (their neutral value is 1)."""
    return SamplingParams(temperature=pb.temperature, top_k=pb.top_k, top_p=pb.top_p or 1.0,
                          min_p=pb.min_p, repetition_penalty=pb.repetition_penalty or 1.0,
                          seed=pb.seed)


@dataclass
class _SeqState:
    """What the servicer tracks of one open sequence to validate the next step."""

    internal_id: int
    num_tokens: int = 0  # committed tokens sent so far


@dataclass
class _Stream:
    """One DraftSteps stream: its peer and its open sequences (stream seq id -> state)."""

    stream_id: int
    peer: str
    seqs: dict[int, _SeqState] = field(default_factory=dict)
    num_steps: int = 0
    is_closed: bool = False


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Serves one Proposer to any number of verifier streams.

    hidden_size: width H* of the hidden rows the proposer expects (0: not checked).
    max_num_draft_tokens: the largest k a step may ask for.
    """

    def __init__(self, proposer: Proposer, *, vocab_size: int, hidden_size: int = 0,
                 max_num_draft_tokens: int = 32, tracer: StepTracer | None = None) -> None:
        self.proposer = proposer
        self.tracer = tracer  # SPECD_DRAFTER_TRACE_STEPS: a profiler trace of some steps (diagnosis)
        self._trace_lock = threading.Lock()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_num_draft_tokens = max_num_draft_tokens
        self._lock = threading.Lock()  # model access and the id counters
        self._internal_ids = itertools.count()
        self._stream_ids = itertools.count()
        self._streams: dict[int, _Stream] = {}
        self.num_sequences_opened = 0  # over the servicer's life (tests, logs)
        self.num_steps_with_attached_rows = 0  # steps whose rows came beside the message (tests)
        self.fast_step_port = 0  # advertised in Info once a FastStepServer serves this servicer

    # ---- RPCs -------------------------------------------------------------------------------
    def Info(self, request, context) -> drafter_pb2.DrafterInfoResponse:
        return drafter_pb2.DrafterInfoResponse(
            method=self.proposer.method, hidden_kind=HIDDEN_KIND_TO_PB[self.proposer.hidden_kind],
            aux_layer_ids=list(getattr(self.proposer, "aux_layer_ids", None) or []),
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            max_num_draft_tokens=self.max_num_draft_tokens, fast_step_port=self.fast_step_port,
            takes_step_hidden_states=True, takes_attached_rows=True)

    def DraftSteps(self, request_iterator, context):
        stream = self.open_stream(context.peer())
        yield from serve_steps(stream, request_iterator, context, self._step, self._close_stream, _status_of)

    def open_stream(self, peer: str) -> _Stream:
        """A new stream's state: gRPC's DraftSteps and the fast socket path (fast_steps.py) each open one."""
        with self._lock:
            stream = _Stream(next(self._stream_ids), peer)
            self._streams[stream.stream_id] = stream
        logger.info("event=stream_open stream=%d peer=%s method=%s", stream.stream_id, stream.peer,
                    self.proposer.method)
        return stream

    # ---- one step ---------------------------------------------------------------------------
    def _step(self, stream: _Stream, request: drafter_pb2.DraftStepRequest, attached_rows=None
              ) -> drafter_pb2.DraftStepResponse:
        """One step. attached_rows: hidden_states' data where it came beside the message (a
        bytes-like object; the fast path's ROWS frames, Info.takes_attached_rows)."""
        if self.tracer is None:
            return self._one_step(stream, request, attached_rows)
        with self._trace_lock:  # while tracing, one step at a time, whole (its answer built inside)
            self.tracer.started()
            try:
                return self._one_step(stream, request, attached_rows)
            finally:
                self.tracer.done()

    def _one_step(self, stream: _Stream, request: drafter_pb2.DraftStepRequest, attached_rows=None
                  ) -> drafter_pb2.DraftStepResponse:
        t0 = time.perf_counter()
        with self._lock, record_function("drafter step: inputs and propose"):
            if stream.is_closed:
                raise StepError(grpc.StatusCode.CANCELLED, "stream already closed")
            for seq_id in request.close:
                state = stream.seqs.pop(seq_id, None)
                if state is not None:
                    self.proposer.close(state.internal_id)
            for item in request.open:
                if item.seq_id in stream.seqs:
                    raise StepError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"open: seq {item.seq_id} is already open on this stream")
                params = sampling_params_from_pb(item.params)
                grammar = GrammarSpec(item.grammar_kind, item.grammar_source) if item.grammar_kind else None
                state = _SeqState(next(self._internal_ids))
                if grammar is None:  # proposers without draft masking take no grammar argument
                    self.proposer.open(state.internal_id, params)
                else:
                    self.proposer.open(state.internal_id, params, grammar=grammar)
                stream.seqs[item.seq_id] = state
                self.num_sequences_opened += 1
            if len({item.seq_id for item in request.sequences}) != len(request.sequences):
                raise invalid("sequences: a seq id appears twice in one step")
            step_rows = self._step_rows(request, attached_rows)
            self.num_steps_with_attached_rows += attached_rows is not None
            requests = [self._draft_request(stream, item, step_rows[i] if step_rows else None)
                        for i, item in enumerate(request.sequences)]
            t1 = time.perf_counter()
            with record_function("drafter step: propose"):
                proposals = self.proposer.propose(requests) if requests else []
            t2 = time.perf_counter()
            for item in request.sequences:
                stream.seqs[item.seq_id].num_tokens += len(item.new_token_ids)
            stream.num_steps += 1
        with record_function("drafter step: answer"):
            response = drafter_pb2.DraftStepResponse(step_id=request.step_id,
                                                     draft_time_us=int((t2 - t1) * 1e6))
            for item, proposal in zip(request.sequences, proposals):
                out = response.sequences.add(seq_id=item.seq_id, token_ids=proposal.token_ids.tolist())
                if proposal.probs is not None:
                    tensor_to_pb(proposal.probs, out.probs)
        response.handle_time_us = int((time.perf_counter() - t0) * 1e6)
        return response

    def _step_rows(self, request: drafter_pb2.DraftStepRequest, attached=None) -> list[torch.Tensor | None] | None:
        """Each sequence's share of the step's one hidden-rows tensor (None: the step has none;
        None for a sequence that brings its own new_hidden_states). attached: its data, where it
        came beside the message."""
        if attached is not None and not request.HasField("hidden_states"):
            raise invalid("hidden rows attached to a step without hidden_states (their dtype and shape)")
        if not request.HasField("hidden_states") or self.proposer.hidden_kind == "none":
            return None
        # (a TensorCodecError, e.g. attached bytes that do not match the shape, is INVALID_ARGUMENT)
        rows = tensor_from_pb(request.hidden_states) if attached is None else \
            tensor_from_buffer(request.hidden_states, attached)
        counts = [item.num_hidden_rows for item in request.sequences if not item.HasField("new_hidden_states")]
        if rows.ndim != 2 or sum(counts) != rows.shape[0]:
            raise invalid(f"hidden_states: shape {list(rows.shape)} for {sum(counts)} rows (num_hidden_rows of "
                          f"the sequences without their own); expected [{sum(counts)}, H*]")
        self._check_rows("hidden_states", rows)  # once for the step, not per share
        shares = iter(rows.split(counts))
        return [None if item.HasField("new_hidden_states") else next(shares) for item in request.sequences]

    def _draft_request(self, stream: _Stream, item: drafter_pb2.SequenceDraftInput,
                       step_rows: torch.Tensor | None = None) -> DraftRequest:
        """Validate one sequence's input against its state and the proposer's contract (step_rows:
        its share of the step's hidden_states)."""
        state = stream.seqs.get(item.seq_id)
        if state is None:
            raise invalid(f"sequences: unknown seq id {item.seq_id} (open it first)")
        k = item.num_draft_tokens
        if not 0 <= k <= self.max_num_draft_tokens:
            raise invalid(f"num_draft_tokens: seq {item.seq_id} asks for {k}; this drafter drafts "
                           f"0..{self.max_num_draft_tokens}")
        tokens = list(item.new_token_ids)
        if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab_size):
            raise invalid(f"new_token_ids: seq {item.seq_id} has ids outside [0, {self.vocab_size})")
        hidden = None
        if self.proposer.hidden_kind != "none":
            own = item.HasField("new_hidden_states")  # else its share of the step's, checked whole
            hidden = tensor_from_pb(item.new_hidden_states) if own else step_rows
            if own:
                self._check_rows(f"new_hidden_states: seq {item.seq_id}", hidden)
            # base.py's alignment: one hidden row fewer than tokens overall.
            want_rows = len(tokens) - (1 if state.num_tokens == 0 and tokens else 0)
            got_rows = 0 if hidden is None else hidden.shape[0]
            if got_rows != want_rows:
                raise invalid(f"new_hidden_states: seq {item.seq_id} sends {len(tokens)} tokens "
                               f"and {got_rows} hidden rows; expected {want_rows} rows")
        return DraftRequest(state.internal_id, tokens, hidden, k, num_output_tokens=item.num_output_tokens)

    def _check_rows(self, where: str, rows: torch.Tensor) -> None:
        """Hidden rows must be [n, H*] floats of this drafter's width."""
        if rows.ndim != 2:
            raise invalid(f"{where}: expected [n, H*], got shape {list(rows.shape)}")
        if not rows.is_floating_point():
            raise invalid(f"{where}: expected floats, got {rows.dtype}")
        if self.hidden_size and rows.shape[1] != self.hidden_size:
            raise invalid(f"{where}: rows of width {rows.shape[1]}, this drafter expects {self.hidden_size}")

    # ---- stream end ---------------------------------------------------------------------------
    def _close_stream(self, stream: _Stream, reason: str) -> None:
        """Close every sequence of the stream (idempotent: several paths end a stream)."""
        with self._lock:
            if stream.is_closed:
                return
            stream.is_closed = True
            for state in stream.seqs.values():
                self.proposer.close(state.internal_id)
            num_open = len(stream.seqs)
            stream.seqs.clear()
            self._streams.pop(stream.stream_id, None)
        logger.info("event=stream_close stream=%d peer=%s reason=%s steps=%d closed_sequences=%d",
                    stream.stream_id, stream.peer, reason, stream.num_steps, num_open)

    @property
    def num_open_sequences(self) -> int:
        """Open sequences over all live streams."""
        with self._lock:
            return sum(len(s.seqs) for s in self._streams.values())

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)
