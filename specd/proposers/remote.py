"""RemoteProposer: the Proposer protocol over one or more drafter services (services/drafter).

Each drafter gets one long-lived DraftSteps stream (sync gRPC: a request queue feeds the stream,
a reader thread drains the responses so a step can wait with a deadline). open() and close() are
buffered and ride along with the next step message. propose() splits the batch by drafter with a
consistent-hash ring over the drafter addresses, sends one message to each drafter at once (the
streams' own threads send them in parallel), waits for all answers and puts the drafts back in
request order.

Failure and lost state. A drafter that does not answer within `deadline_s`, breaks its stream or
refuses a step raises DrafterError (DrafterUnavailableError for transport failures). propose()
runs in the engine's draft verb, before verify and commit, so the engine's hard state (tokens,
target KV cache) is untouched; what is lost is soft state:
  - the failed drafter's draft state for all of its sequences (`lost_seq_ids`): the drafter
    closes a stream's sequences when the stream ends, and this proposer treats that drafter as
    dead from then on (its sequences raise again on the next propose);
  - the committed tokens and hidden rows of this step for those sequences, which the engine has
    already handed over (Sequence.take_undrafted). Recovery reopens the sequences elsewhere with
    their full token history, which the engine holds.
Sequences on healthy drafters stay consistent: their message was answered, so their drafters
ingested the new tokens, and their (unused) drafts are speculative state rolled back next step.
"""

from __future__ import annotations

import bisect
import hashlib
import queue
import threading
import time

import grpc
import torch

from specd.proposers.base import DraftProposal, DraftRequest, HiddenKind
from specd.sampling_params import SamplingParams
from specd.transport.tensor_codec import tensor_from_pb, tensor_to_pb
from specd.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

HIDDEN_KIND_FROM_PB: dict[int, HiddenKind] = {drafter_pb2.HIDDEN_KIND_NONE: "none",
                                               drafter_pb2.HIDDEN_KIND_FINAL: "final",
                                               drafter_pb2.HIDDEN_KIND_AUX: "aux"}
_REJECTED_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                   grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INTERNAL)
_MAX_MESSAGE_BYTES = 256 << 20
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)]


class DrafterError(RuntimeError):
    """A drafter failed a step; its draft state for `lost_seq_ids` is gone (see the module doc)."""

    def __init__(self, address: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"drafter {address}: {message}")
        self.address = address
        self.code = code
        self.lost_seq_ids: list[int] = []


class DrafterUnavailableError(DrafterError):
    """The drafter is unreachable, missed the step deadline, or its stream broke."""


class DrafterRejectedError(DrafterError):
    """The drafter refused a step as malformed (a bug on this side, not a transient failure)."""


def _error_from_rpc(address: str, err: grpc.RpcError) -> DrafterError:
    code, details = err.code(), err.details()
    cls = DrafterRejectedError if code in _REJECTED_CODES else DrafterUnavailableError
    return cls(address, f"{code.name}: {details}", code)


def sampling_params_to_pb(params: SamplingParams) -> common_pb2.SamplingParameters:
    return common_pb2.SamplingParameters(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, seed=params.seed)


class HashRing:
    """Consistent hashing of integer keys onto nodes: adding or removing a node moves only the
    keys of the arcs it gains or loses (about 1/N of them), `replicas` virtual points per node."""

    def __init__(self, nodes: list[str] = (), replicas: int = 64) -> None:
        self.replicas = replicas
        self._points: list[tuple[int, str]] = []  # sorted (hash, node)
        for node in nodes:
            self.add(node)

    @staticmethod
    def _hash(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")

    @property
    def nodes(self) -> list[str]:
        return sorted({node for _, node in self._points})

    def add(self, node: str) -> None:
        if node in self.nodes:
            raise ValueError(f"drafter {node} is already on the ring")
        for i in range(self.replicas):
            bisect.insort(self._points, (self._hash(f"{node}#{i}"), node))

    def remove(self, node: str) -> None:
        self._points = [p for p in self._points if p[1] != node]

    def lookup(self, key: int) -> str:
        if not self._points:
            raise LookupError("the hash ring has no drafters")
        i = bisect.bisect(self._points, (self._hash(str(key)), "")) % len(self._points)
        return self._points[i][1]


class _DrafterStream:
    """One drafter: channel, Info, the DraftSteps stream and the open/close ops not yet sent."""

    def __init__(self, address: str, connect_timeout_s: float) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        stub = drafter_pb2_grpc.DrafterStub(self.channel)
        try:  # wait_for_ready: a drafter still starting up is waited for, up to the timeout
            self.info = stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=connect_timeout_s,
                                  wait_for_ready=True)
        except grpc.RpcError as err:
            self.channel.close()
            raise DrafterUnavailableError(address, f"Info failed: {err.code().name}: {err.details()}",
                                          err.code()) from None
        self._requests: queue.SimpleQueue = queue.SimpleQueue()  # None half-closes the stream
        self._responses: queue.SimpleQueue = queue.SimpleQueue()  # responses or a DrafterError
        self._call = stub.DraftSteps(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read, name=f"drafter-{address}", daemon=True)
        self._reader.start()
        self.pending_open: dict[int, tuple[SamplingParams, object]] = {}  # seq -> (params, grammar)
        self.pending_close: list[int] = []
        self.next_step_id = 0
        self.error: DrafterError | None = None  # set once: the stream is dead after it

    def _read(self) -> None:
        try:
            for response in self._call:
                self._responses.put(response)
            self._responses.put(DrafterUnavailableError(self.address, "the drafter ended the stream"))
        except grpc.RpcError as err:
            self._responses.put(_error_from_rpc(self.address, err))

    def send(self, message: drafter_pb2.DraftStepRequest) -> None:
        message.step_id = self.next_step_id
        self.next_step_id += 1
        self._requests.put(message)

    def receive(self, step_id: int, deadline: float) -> drafter_pb2.DraftStepResponse:
        """The answer to step_id, by `deadline` (time.monotonic()); marks the stream dead on failure."""
        try:
            item = self._responses.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self._call.cancel()
            item = DrafterUnavailableError(self.address, f"no answer to step {step_id} within the deadline",
                                           grpc.StatusCode.DEADLINE_EXCEEDED)
        if not isinstance(item, DrafterError) and item.step_id != step_id:
            self._call.cancel()
            item = DrafterError(self.address, f"answered step {item.step_id}, expected {step_id}")
        if isinstance(item, DrafterError):
            self.error = item
            raise item
        return item

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Half-close (the drafter drops this stream's sequences), then close the channel."""
        self._requests.put(None)
        self._reader.join(timeout_s)
        self.channel.close()


class RemoteProposer:
    """Proposer whose draft state lives on drafter services at `addresses` ("host:port").

    deadline_s bounds one step's round trip; hidden_dtype casts hidden rows before sending
    (None: as the target produced them). After each propose, last_rpc_seconds is the step's wall
    time here and last_draft_seconds the slowest drafter's model time (the rest is transport).
    """

    draft_constraints = None  # remote drafters mask drafts themselves

    def __init__(self, addresses: list[str], *, deadline_s: float = 10.0,
                 connect_timeout_s: float = 10.0, hidden_dtype: torch.dtype | None = None) -> None:
        if not addresses:
            raise ValueError("addresses: need at least one drafter address")
        self.deadline_s = deadline_s
        self.hidden_dtype = hidden_dtype
        self._drafters: dict[str, _DrafterStream] = {}
        self._owner: dict[int, _DrafterStream] = {}  # open seq id -> its drafter
        try:
            for address in dict.fromkeys(addresses):
                self._drafters[address] = _DrafterStream(address, connect_timeout_s)
        except DrafterError:
            self.shutdown()
            raise
        infos = {a: d.info for a, d in self._drafters.items()}
        first = next(iter(infos.values()))
        contract = lambda i: (i.method, i.hidden_kind, list(i.aux_layer_ids), i.vocab_size)  # noqa: E731
        if any(contract(i) != contract(first) for i in infos.values()):
            self.shutdown()
            raise ValueError("addresses: the drafters disagree on method / hidden states / vocab: "
                             + "; ".join(f"{a}: {contract(i)}" for a, i in infos.items()))
        self.method: str = first.method
        self.hidden_kind: HiddenKind = HIDDEN_KIND_FROM_PB[first.hidden_kind]
        self.aux_layer_ids: list[int] = list(first.aux_layer_ids)  # build_engine sets the runner's
        self.vocab_size = int(first.vocab_size)
        self.max_num_draft_tokens = min(i.max_num_draft_tokens for i in infos.values())
        self._ring = HashRing(list(self._drafters))
        self.last_rpc_seconds = 0.0
        self.last_draft_seconds = 0.0

    @property
    def addresses(self) -> list[str]:
        return list(self._drafters)

    def drafter_of(self, seq_id: int) -> str:
        """The address that holds (or would hold) the sequence's draft state."""
        owner = self._owner.get(seq_id)
        return owner.address if owner is not None else self._ring.lookup(seq_id)

    # ---- the Proposer protocol --------------------------------------------------------------
    def open(self, seq_id: int, params: SamplingParams, grammar=None) -> None:
        if seq_id in self._owner:
            raise ValueError(f"seq {seq_id}: already open")
        drafter = self._drafters[self._ring.lookup(seq_id)]
        drafter.pending_open[seq_id] = (params, grammar)
        self._owner[seq_id] = drafter

    def close(self, seq_id: int) -> None:
        drafter = self._owner.pop(seq_id, None)
        if drafter is None or drafter.error is not None:
            return
        if drafter.pending_open.pop(seq_id, None) is None:  # never sent: nothing to close remotely
            drafter.pending_close.append(seq_id)

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        t0 = time.perf_counter()
        groups: dict[str, list[int]] = {}  # address -> indices into requests
        for i, r in enumerate(requests):
            if r.seq_id not in self._owner:
                raise ValueError(f"seq {r.seq_id}: propose before open")
            groups.setdefault(self._owner[r.seq_id].address, []).append(i)
        for address in groups:
            self._raise_if_dead(self._drafters[address])
        targets = [d for a, d in self._drafters.items()
                   if d.error is None and (a in groups or d.pending_open or d.pending_close)]
        sent = {d.address: self._send(d, [requests[i] for i in groups.get(d.address, [])]) for d in targets}
        deadline = time.monotonic() + self.deadline_s
        responses, failure = {}, None
        for d in targets:  # every healthy stream is drained, so step ids stay in sync
            try:
                responses[d.address] = d.receive(sent[d.address], deadline)
            except DrafterError as err:
                failure = failure or err
        if failure is not None:
            self._raise_if_dead(self._drafters[failure.address])
        out: list[DraftProposal | None] = [None] * len(requests)
        for address, indices in groups.items():
            answer = responses[address]
            if [s.seq_id for s in answer.sequences] != [requests[i].seq_id for i in indices]:
                self._drafters[address].error = DrafterError(address, "answered for other sequences")
                self._raise_if_dead(self._drafters[address])
            for i, seq in zip(indices, answer.sequences):
                probs = tensor_from_pb(seq.probs) if seq.HasField("probs") else None
                out[i] = DraftProposal(torch.tensor(seq.token_ids, dtype=torch.long), probs)
        self.last_draft_seconds = max((r.draft_time_us for r in responses.values()), default=0) / 1e6
        self.last_rpc_seconds = time.perf_counter() - t0
        return out

    # ---- beyond the protocol ----------------------------------------------------------------
    def flush(self) -> None:
        """Send buffered opens and closes now (an idle verifier frees its drafters' state)."""
        self.propose([])

    def shutdown(self) -> None:
        """End every stream (each drafter drops this proposer's sequences) and close channels."""
        for drafter in self._drafters.values():
            drafter.shutdown()
        self._owner.clear()

    def __enter__(self) -> "RemoteProposer":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- helpers -----------------------------------------------------------------------------
    def _send(self, drafter: _DrafterStream, requests: list[DraftRequest]) -> int:
        """Build and queue one step message; returns its step id."""
        message = drafter_pb2.DraftStepRequest(close=drafter.pending_close)
        for seq_id, (params, grammar) in drafter.pending_open.items():
            message.open.add(seq_id=seq_id, params=sampling_params_to_pb(params),
                             grammar_kind=grammar.kind if grammar else "",
                             grammar_source=grammar.source if grammar else "")
        drafter.pending_open, drafter.pending_close = {}, []
        for r in requests:
            item = message.sequences.add(seq_id=r.seq_id, new_token_ids=r.new_token_ids,
                                         num_draft_tokens=r.num_draft_tokens,
                                         num_output_tokens=r.num_output_tokens)
            if r.new_hidden_states is not None and self.hidden_kind != "none":
                hidden = r.new_hidden_states  # [n, H*]
                assert hidden.ndim == 2, f"new_hidden_states must be [n, H*], got {tuple(hidden.shape)}"
                tensor_to_pb(hidden if self.hidden_dtype is None else hidden.to(self.hidden_dtype),
                             item.new_hidden_states)
        step_id = drafter.next_step_id
        drafter.send(message)
        return step_id

    def _raise_if_dead(self, drafter: _DrafterStream) -> None:
        if drafter.error is not None:
            drafter.error.lost_seq_ids = sorted(s for s, d in self._owner.items() if d is drafter)
            raise drafter.error
