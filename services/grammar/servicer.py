"""GrammarServicer: the Grammar gRPC service over the in-process core (specd.grammar).

Thin by design: Validate is GrammarCompilerCache.validate, and each GrammarStepRequest becomes
close / open / one LocalGrammarBackend.step over the whole list, answered by one
GrammarStepResponse. What the servicer adds is what a shared network service needs:
  - each Steps stream gets its own LocalGrammarBackend, so sequence ids are scoped per stream
    (two verifiers may both use seq 0) and a stream that ends (the verifier finished or died)
    drops all of its matchers; compiled grammars are shared by all streams through one cache;
  - streams run in parallel (sync gRPC gives each one a thread); a per-stream lock only guards
    against the end-of-RPC callback racing a step;
  - every step is validated before the matchers see it, and errors are mapped to status codes in
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

from services.common.step_streams import StepError, invalid, serve_steps
from specd.grammar.backend import GrammarSpec, GrammarStep
from specd.grammar.compiler import GrammarCompilerCache
from specd.grammar.errors import GrammarCompileError, GrammarNotOpenError, GrammarViolation
from specd.grammar.local import LocalGrammarBackend
from specd.messages import ConfigError
from specd.transport.tensor_codec import tensor_to_pb
from specd.v1 import grammar_pb2, grammar_pb2_grpc

logger = logging.getLogger(__name__)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place where errors become gRPC statuses."""
    if isinstance(exc, StepError):
        return exc.code, str(exc)
    if isinstance(exc, (GrammarCompileError, ConfigError)):  # the request's grammar
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, GrammarNotOpenError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, GrammarViolation):  # tokens the matcher's state does not allow
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    return grpc.StatusCode.INTERNAL, f"grammar service internal error: {type(exc).__name__}: {exc}"


def spec_from_pb(pb: grammar_pb2.GrammarSpec) -> GrammarSpec:
    """The domain spec; the kind is checked by the compiler (an unknown kind does not compile)."""
    return GrammarSpec(pb.kind, pb.source)


@dataclass
class _Stream:
    """One Steps stream: its peer, its matchers (stream seq id -> matcher) and counters."""

    stream_id: int
    peer: str
    backend: LocalGrammarBackend
    lock: threading.Lock = field(default_factory=threading.Lock)
    num_steps: int = 0
    is_closed: bool = False


class GrammarServicer(grammar_pb2_grpc.GrammarServicer):
    """Serves one model's grammars (one GrammarCompilerCache) to any number of verifier streams."""

    def __init__(self, compiler_cache: GrammarCompilerCache) -> None:
        self.compiler_cache = compiler_cache
        self.vocab_size = compiler_cache.vocab_size
        self._lock = threading.Lock()  # the stream table and the id counter
        self._stream_ids = itertools.count()
        self._streams: dict[int, _Stream] = {}
        self.num_sequences_opened = 0  # over the servicer's life (tests, logs)

    # ---- RPCs -------------------------------------------------------------------------------
    def Validate(self, request: grammar_pb2.GrammarSpec, context) -> grammar_pb2.ValidateResponse:
        """A grammar that does not compile is an answer (ok=false), not an RPC error."""
        try:
            self.compiler_cache.validate(spec_from_pb(request))
        except ConfigError as exc:  # GrammarCompileError included
            return grammar_pb2.ValidateResponse(ok=False, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - mapped like every other failure
            code, message = _status_of(exc)
            logger.exception("Validate failed")
            context.abort(code, message)
        return grammar_pb2.ValidateResponse(ok=True)

    def Steps(self, request_iterator, context):
        with self._lock:
            stream = _Stream(next(self._stream_ids), context.peer(), LocalGrammarBackend(self.compiler_cache))
            self._streams[stream.stream_id] = stream
        logger.info("event=stream_open stream=%d peer=%s", stream.stream_id, stream.peer)
        yield from serve_steps(stream, request_iterator, context, self._step, self._close_stream, _status_of)

    # ---- one step ---------------------------------------------------------------------------
    def _step(self, stream: _Stream, request: grammar_pb2.GrammarStepRequest
              ) -> grammar_pb2.GrammarStepResponse:
        t0 = time.perf_counter()
        with stream.lock:
            if stream.is_closed:
                raise StepError(grpc.StatusCode.CANCELLED, "stream already closed")
            backend = stream.backend
            for seq_id in request.close:
                backend.close(seq_id)
            opens = [self._open_args(backend, item) for item in request.open]
            if len({seq_id for seq_id, _, _ in opens}) != len(opens):
                raise invalid("open: a seq id appears twice in one step")
            for seq_id, spec, replay in opens:
                backend.open(seq_id, spec, replay)
                self.num_sequences_opened += 1
            step = GrammarStep(commits=self._commits(backend, request), drafts=self._drafts(backend, request),
                               budgets=self._budgets(request))
            t1 = time.perf_counter()
            results = backend.step(step)
            t2 = time.perf_counter()
            touched = dict.fromkeys([*step.commits, *step.drafts])
            terminated = [s for s in touched if backend.get(s).is_terminated()]
            stream.num_steps += 1
        response = grammar_pb2.GrammarStepResponse(step_id=request.step_id, terminated=terminated,
                                                   mask_time_us=int((t2 - t1) * 1e6))
        for seq_id, result in results.items():  # step.drafts order: the request's order
            out = response.masks.add(seq_id=seq_id, num_valid_drafts=result.num_valid_drafts,
                                     num_closing_rows=result.num_closing_rows)
            tensor_to_pb(result.bitmask, out.bitmask)
        response.handle_time_us = int((time.perf_counter() - t0) * 1e6)
        return response

    def _check_ids(self, what: str, seq_id: int, token_ids) -> list[int]:
        tokens = [int(t) for t in token_ids]
        if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab_size):
            raise invalid(f"{what}: seq {seq_id} has token ids outside [0, {self.vocab_size})")
        return tokens

    def _open_args(self, backend: LocalGrammarBackend, item: grammar_pb2.OpenMatcher
                   ) -> tuple[int, GrammarSpec, list[int]]:
        if item.seq_id in backend:
            raise StepError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"open: seq {item.seq_id} is already open on this stream (close it first)")
        if not item.HasField("spec"):
            raise invalid(f"open: seq {item.seq_id} has no grammar spec")
        return item.seq_id, spec_from_pb(item.spec), self._check_ids("open.replay_token_ids", item.seq_id,
                                                                     item.replay_token_ids)

    def _commits(self, backend: LocalGrammarBackend, request: grammar_pb2.GrammarStepRequest
                 ) -> dict[int, list[int]]:
        commits: dict[int, list[int]] = {}
        for item in request.commit:
            if item.seq_id in commits:
                raise invalid(f"commit: seq {item.seq_id} appears twice in one step")
            if item.seq_id not in backend:
                raise invalid(f"commit: unknown seq id {item.seq_id} (open it first)")
            commits[item.seq_id] = self._check_ids("commit.token_ids", item.seq_id, item.token_ids)
        return commits

    def _drafts(self, backend: LocalGrammarBackend, request: grammar_pb2.GrammarStepRequest
                ) -> dict[int, list[int]]:
        drafts: dict[int, list[int]] = {}
        for item in request.masks:
            if item.seq_id in drafts:
                raise invalid(f"masks: seq {item.seq_id} appears twice in one step")
            if item.seq_id not in backend:
                raise invalid(f"masks: unknown seq id {item.seq_id} (open it first)")
            drafts[item.seq_id] = self._check_ids("masks.draft_token_ids", item.seq_id, item.draft_token_ids)
        return drafts

    @staticmethod
    def _budgets(request: grammar_pb2.GrammarStepRequest) -> dict[int, int]:
        """remaining_tokens per sequence (0: unbounded, left out); negative is refused."""
        budgets: dict[int, int] = {}
        for item in request.masks:
            if item.remaining_tokens < 0:
                raise invalid(f"masks: seq {item.seq_id} has remaining_tokens {item.remaining_tokens} (must be >= 0)")
            if item.remaining_tokens:
                budgets[item.seq_id] = item.remaining_tokens
        return budgets

    # ---- stream end ---------------------------------------------------------------------------
    def _close_stream(self, stream: _Stream, reason: str) -> None:
        """Drop every matcher of the stream (idempotent: several paths end a stream)."""
        with stream.lock:
            if stream.is_closed:
                return
            stream.is_closed = True
            num_open = len(stream.backend)
            stream.backend = LocalGrammarBackend(self.compiler_cache)  # the old matchers go with it
        with self._lock:
            self._streams.pop(stream.stream_id, None)
        logger.info("event=stream_close stream=%d peer=%s reason=%s steps=%d closed_sequences=%d",
                    stream.stream_id, stream.peer, reason, stream.num_steps, num_open)

    @property
    def num_open_sequences(self) -> int:
        """Open matchers over all live streams."""
        with self._lock:
            return sum(len(s.backend) for s in self._streams.values())

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)
