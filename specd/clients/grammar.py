"""RemoteGrammarBackend: the GrammarBackend contract over the grammar service (services/grammar).

One long-lived Steps stream per backend (specd/clients/step_stream.py). open() and close() are buffered
and ride along with the next step message, so an engine step costs exactly one round trip:
close, open (with replay tokens), commit, masks, in that order, in one GrammarStepRequest.

Failure and recovery. The service drops a stream's matchers when the stream ends, but matchers
are soft state: each is its grammar plus the accepted tokens, which this backend records as it
sends them. A service that breaks the stream or misses `deadline_s` is left for the next replica
of `address` ("host:port,host:port", tried in turn, the same one again when it is alone, with
backoff), and the step is sent again on a fresh stream that first reopens every matcher by
replaying its accepted tokens: the masks are those the lost matchers would have given, so
constrained output stays valid and identical. Only when no replica answers within
`recover_timeout_s` does a step raise GrammarUnavailableError; a step the service refused
(GrammarRejectedError: unknown sequence, tokens the grammar rejects, a grammar that does not
compile) raises at once. Either way every matcher is forgotten (`err.lost_seq_ids`) and the
caller may reopen them with open(seq_id, spec, replay_token_ids=...).
"""

from __future__ import annotations

import logging
import time

import grpc
import torch

from specd.clients.channel import open_channel
from specd.clients.errors import GrammarRejectedError, GrammarServiceError, GrammarUnavailableError
from specd.clients.step_stream import GrpcStepStream
from specd.grammar.backend import GrammarSpec, GrammarStep, MaskResult
from specd.grammar.errors import GrammarCompileError, GrammarNotOpenError  # compiler.py's, without xgrammar
from specd.transport.tensor_codec import TensorCodecError, tensor_from_pb
from specd.v1 import grammar_pb2, grammar_pb2_grpc

_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

log = logging.getLogger("specd.clients.grammar")


def spec_to_pb(spec: GrammarSpec, model: str = "") -> grammar_pb2.GrammarSpec:
    return grammar_pb2.GrammarSpec(kind=spec.kind, source=spec.source, model=model)


class RemoteGrammarBackend:
    """GrammarBackend whose matchers live on the grammar service at `address` ("host:port", or
    several replicas comma-separated).

    deadline_s bounds one step's round trip and one Validate; recover_timeout_s how long a step
    keeps trying replicas after a failure. model is sent in every GrammarSpec (informational).
    After each step, last_rpc_seconds is the step's wall time here, last_mask_seconds the
    service's time in the matchers (the rest is transport and encoding).
    """

    def __init__(self, address: str, *, deadline_s: float = 10.0, model: str = "",
                 recover_timeout_s: float = 60.0, retry_backoff_s: float = 0.05,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s: must be > 0, got {deadline_s}")
        if recover_timeout_s < 0 or retry_backoff_s <= 0:
            raise ValueError("recover_timeout_s: must be >= 0; retry_backoff_s: must be > 0")
        self.addresses = [a.strip() for a in address.split(",") if a.strip()]
        if not self.addresses:
            raise ValueError(f"address: expected host:port[,host:port...], got {address!r}")
        self.deadline_s = deadline_s
        self.recover_timeout_s = recover_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.model = model
        self.credentials = credentials  # TLS for the replica channels; None: plaintext
        self._channels: dict[str, grpc.Channel] = {}
        self._current = 0  # index into addresses of the replica in use
        self._stream: GrpcStepStream | None = None  # started by the first step, again after a failure
        self._next_step_id = 0  # of the stream
        # seq id -> (grammar, accepted tokens sent so far): what rebuilds a lost matcher.
        self._history: dict[int, tuple[GrammarSpec, list[int]]] = {}
        self._pending_open: set[int] = set()  # opened since the last step
        self._pending_close: list[int] = []
        self.num_recoveries = 0  # streams replaced after a failure (tests, logs)
        self._mask_width: int | None = None  # W of the first bitmask: the vocabulary's, every one after
        self.last_rpc_seconds = 0.0
        self.last_mask_seconds = 0.0
        self.last_handle_seconds = 0.0  # the service's whole handling time, compiles included

    @property
    def address(self) -> str:
        """The replica in use."""
        return self.addresses[self._current]

    def __len__(self) -> int:
        return len(self._history)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._history

    # ---- the GrammarBackend protocol ----------------------------------------------------------
    def open(self, seq_id: int, spec: GrammarSpec, replay_token_ids: list[int] | None = None) -> None:
        """Buffer a matcher for seq_id (replacing any); sent, and compiled, with the next step."""
        if seq_id in self._history:
            self.close(seq_id)
        self._history[seq_id] = (spec, [int(t) for t in replay_token_ids or []])
        self._pending_open.add(seq_id)

    def step(self, step: GrammarStep) -> dict[int, MaskResult]:
        """One round trip: buffered closes and opens, then step's commits and masks."""
        t0 = time.perf_counter()
        for seq_id in (*step.commits, *step.drafts):
            if seq_id not in self._history:
                raise GrammarNotOpenError(f"grammar: sequence {seq_id} has no open matcher")
        message = grammar_pb2.GrammarStepRequest(close=self._pending_close)
        self._add_opens(message, [s for s in self._history if s in self._pending_open])
        for seq_id, tokens in step.commits.items():
            if tokens:
                message.commit.add(seq_id=seq_id, token_ids=tokens)
                self._history[seq_id][1].extend(int(t) for t in tokens)
        self._pending_open, self._pending_close = set(), []
        self._add_masks(message, step)
        give_up_at = time.monotonic() + self.recover_timeout_s
        delay = self.retry_backoff_s
        while True:
            try:
                response = self._exchange(message)
                results = self._results(response, step)
                break
            except GrammarRejectedError as err:
                raise self._lose_all(err) from None
            except GrammarServiceError as err:
                self._drop_stream()
                if time.monotonic() + delay > give_up_at:
                    raise self._lose_all(err) from None
                log.warning("grammar service failed, rebuilding %d matchers on the next replica: %s",
                            len(self._history), err)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                self._current = (self._current + 1) % len(self.addresses)
                self.num_recoveries += 1
                message = self._replay_message(step)
        self.last_mask_seconds = response.mask_time_us / 1e6
        self.last_handle_seconds = response.handle_time_us / 1e6
        self.last_rpc_seconds = time.perf_counter() - t0
        return results

    def close(self, seq_id: int) -> None:
        """Drop seq_id's matcher with the next step (closing an unknown id is a no-op)."""
        if self._history.pop(seq_id, None) is None:
            return
        if seq_id in self._pending_open:  # never sent: nothing to close remotely
            self._pending_open.discard(seq_id)
        else:
            self._pending_close.append(seq_id)

    # ---- beyond the protocol ------------------------------------------------------------------
    def validate(self, spec: GrammarSpec) -> None:
        """GrammarCompileError with the service's message when spec does not compile (any replica)."""
        for attempt in range(len(self.addresses)):
            try:
                reply = self._stub().Validate(spec_to_pb(spec, self.model), timeout=self.deadline_s,
                                              wait_for_ready=True)
                break
            except grpc.RpcError as err:
                if err.code() not in _RETRY_CODES or attempt == len(self.addresses) - 1:
                    raise GrammarUnavailableError(self.address, f"Validate failed: {err.code().name}: "
                                                                f"{err.details()}", err.code()) from None
                self._current = (self._current + 1) % len(self.addresses)
        if not reply.ok:
            raise GrammarCompileError(reply.error)

    def flush(self) -> None:
        """Send buffered opens and closes now (opens compile; an idle verifier frees matchers)."""
        self.step(GrammarStep())

    def shutdown(self) -> None:
        """End the stream (the service drops this backend's matchers) and close the channels."""
        if self._stream is not None:
            self._stream.shutdown()
            self._stream = None
        self._history.clear()
        self._pending_open, self._pending_close = set(), []
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def __enter__(self) -> "RemoteGrammarBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- helpers ------------------------------------------------------------------------------
    def _stub(self) -> grammar_pb2_grpc.GrammarStub:
        channel = self._channels.get(self.address)
        if channel is None:
            channel = self._channels[self.address] = open_channel(self.address, self.credentials)
        return grammar_pb2_grpc.GrammarStub(channel)

    def _exchange(self, message: grammar_pb2.GrammarStepRequest) -> grammar_pb2.GrammarStepResponse:
        """Send one step on the stream (a fresh one after a failure) and wait for its answer;
        raises GrammarServiceError (the stream is dead)."""
        if self._stream is None:
            # wait_for_ready: a service still starting is waited for (the step deadline still applies).
            steps = self._stub().Steps
            self._stream = GrpcStepStream(lambda requests: steps(requests, wait_for_ready=True),
                                          self.address, GrammarServiceError)
            self._next_step_id = 0
        step_id = message.step_id = self._next_step_id
        self._next_step_id += 1
        self._stream.send(message)
        return self._stream.receive(step_id, time.monotonic() + self.deadline_s)[0]

    def _add_opens(self, message: grammar_pb2.GrammarStepRequest, seq_ids) -> None:
        for seq_id in seq_ids:
            spec, tokens = self._history[seq_id]
            message.open.add(seq_id=seq_id, spec=spec_to_pb(spec, self.model), replay_token_ids=tokens)

    def _replay_message(self, step: GrammarStep) -> grammar_pb2.GrammarStepRequest:
        """The step for a fresh stream: every matcher rebuilt from its history (this step's commits
        included), then the same masks."""
        message = grammar_pb2.GrammarStepRequest()
        self._add_opens(message, list(self._history))
        self._add_masks(message, step)
        return message

    @staticmethod
    def _add_masks(message: grammar_pb2.GrammarStepRequest, step: GrammarStep) -> None:
        for seq_id, drafts in step.drafts.items():  # remaining_tokens 0: no budget
            message.masks.add(seq_id=seq_id, draft_token_ids=drafts, remaining_tokens=step.budgets.get(seq_id, 0))

    def _results(self, response: grammar_pb2.GrammarStepResponse, step: GrammarStep) -> dict[int, MaskResult]:
        if [m.seq_id for m in response.masks] != list(step.drafts):
            raise GrammarServiceError(self.address, "answered for other sequences than asked")
        terminated = set(response.terminated)
        try:
            results = {m.seq_id: MaskResult(bitmask=tensor_from_pb(m.bitmask, copy=True),  # [n + 1, W] int32
                                            num_valid_drafts=m.num_valid_drafts,
                                            terminated=m.seq_id in terminated,
                                            num_closing_rows=m.num_closing_rows)
                       for m in response.masks}
        except TensorCodecError as err:
            raise GrammarServiceError(self.address, f"bad bitmask: {err}") from None
        for seq_id, r in results.items():
            fault = self._malformed(r, len(step.drafts[seq_id]))
            if fault is not None:  # a version skew or a bug: as a failed replica, never applied
                raise GrammarServiceError(self.address, f"seq {seq_id}: {fault}")
        return results

    def _malformed(self, r: MaskResult, num_drafts: int) -> str | None:
        """What breaks MaskResult's contract, or None. Rows past num_valid_drafts + 1 would mask
        the next request's logits rows; another width would fail the step's bitmask kernel."""
        b = r.bitmask
        if b.dim() != 2 or b.dtype != torch.int32:
            return f"bitmask of shape {tuple(b.shape)} and {b.dtype}, not [rows, W] int32"
        if not 0 <= r.num_valid_drafts <= num_drafts or b.shape[0] != r.num_valid_drafts + 1:
            return f"{b.shape[0]} bitmask rows, {r.num_valid_drafts} valid drafts of {num_drafts}"
        if not 0 <= r.num_closing_rows <= b.shape[0]:
            return f"{r.num_closing_rows} closing rows of {b.shape[0]}"
        if self._mask_width is None:
            self._mask_width = b.shape[1]
        if b.shape[1] != self._mask_width:
            return f"bitmask width {b.shape[1]}, not {self._mask_width} as before"
        return None

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.shutdown(timeout_s=0.1)
            self._stream = None

    def _lose_all(self, err: GrammarServiceError) -> GrammarServiceError:
        """Give up: forget every matcher, start afresh next call."""
        self._drop_stream()
        err.lost_seq_ids = sorted(self._history)
        self._history.clear()
        self._pending_open, self._pending_close = set(), []
        return err
