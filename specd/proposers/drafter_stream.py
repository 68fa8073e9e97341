"""One drafter connection: channel, Info, the DraftSteps stream, and the errors it raises.

Sync gRPC: a request queue feeds the stream and a reader thread drains the responses, so a step
can wait for its answer with a deadline. send() hands a step to gRPC's sender thread and waits
(up to `handoff_s`) until that thread has taken it: left alone, the sender thread waits for the
GIL while the engine thread runs its commit and emit, ~0.26 ms a step on the H200 machine. A stream that fails once is dead (`error` is set): the
drafter drops a stream's sequences when it ends, so the owner (RemoteProposer) starts a new one.
Also the consistent-hash ring that spreads sequences over drafters.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import queue
import threading
import time

import grpc

from specd.sampling_params import SamplingParams
from specd.transport.grpc_client import CHANNEL_OPTIONS, REJECTED_CODES
from specd.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc



# How long send() waits for gRPC's sender thread to take a step (seconds); "0" turns the wait off
# (the e2e bench's "-nohandoff" variant). A wait that times out is harmless: the step still goes.
SEND_HANDOFF_ENV = "SPECD_DRAFT_SEND_HANDOFF"
DEFAULT_SEND_HANDOFF_S = 0.002


def send_handoff_s() -> float:
    value = os.environ.get(SEND_HANDOFF_ENV)
    return DEFAULT_SEND_HANDOFF_S if value is None or value == "1" else float(value)


class DrafterError(RuntimeError):
    """A drafter failed a step; its draft state for `lost_seq_ids` is gone."""

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
    cls = DrafterRejectedError if code in REJECTED_CODES else DrafterUnavailableError
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


class DrafterStream:
    """One drafter: channel, Info, the DraftSteps stream and the open/close ops not yet sent."""

    def __init__(self, address: str, connect_timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None, handoff_s: float | None = None) -> None:
        self.address = address
        self.handoff_s = send_handoff_s() if handoff_s is None else handoff_s
        self.channel = (grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS) if credentials
                        else grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
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
        self._left_at: dict[int, float] = {}  # step id -> when gRPC's sender pulled it from the queue
        self._taken = threading.Event()  # set when the sender thread takes a step (send() waits on it)
        self._call = stub.DraftSteps(self._outgoing())
        self._reader = threading.Thread(target=self._read, name=f"drafter-{address}", daemon=True)
        self._reader.start()
        self.pending_open: dict[int, tuple[SamplingParams, object]] = {}  # seq -> (params, grammar)
        self.pending_close: list[int] = []
        self.next_step_id = 0
        self.error: DrafterError | None = None  # set once: the stream is dead after it
        # the last received step: when its request left the queue, and when its answer arrived
        # (perf_counter; the round trip's split, RemoteProposer.last_round_trip)
        self.last_left_at = self.last_arrived_at = 0.0

    def _outgoing(self):
        """The request stream as gRPC's sender thread pulls it (None half-closes it)."""
        while (message := self._requests.get()) is not None:
            self._left_at[message.step_id] = time.perf_counter()
            self._taken.set()
            yield message

    def _read(self) -> None:
        try:
            for response in self._call:
                self._responses.put((response, time.perf_counter()))
            self._responses.put(DrafterUnavailableError(self.address, "the drafter ended the stream"))
        except grpc.RpcError as err:
            self._responses.put(_error_from_rpc(self.address, err))

    def send(self, message: drafter_pb2.DraftStepRequest) -> None:
        message.step_id = self.next_step_id
        self.next_step_id += 1
        self._taken.clear()
        self._requests.put(message)
        if self.handoff_s > 0:
            # Blocking here releases the GIL to the sender thread, which then serialises the step
            # and hands it to gRPC's core (where it drops the GIL again) before this thread resumes.
            self._taken.wait(self.handoff_s)

    def receive(self, step_id: int, deadline: float) -> drafter_pb2.DraftStepResponse:
        """The answer to step_id, by `deadline` (time.monotonic()); marks the stream dead on failure."""
        try:
            item = self._responses.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self._call.cancel()
            item = DrafterUnavailableError(self.address, f"no answer to step {step_id} within the deadline",
                                           grpc.StatusCode.DEADLINE_EXCEEDED)
        if not isinstance(item, DrafterError):
            item, self.last_arrived_at = item
            self.last_left_at = self._left_at.pop(item.step_id, self.last_arrived_at)
            if item.step_id != step_id:
                self._call.cancel()
                item = DrafterError(self.address, f"answered step {item.step_id}, expected {step_id}")
        if isinstance(item, DrafterError):
            self.error = item
            raise item
        return item

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Half-close (the drafter drops this stream's sequences), then close the channel."""
        self._requests.put(None)
        if self.error is not None:  # a dead (maybe hung) drafter: do not wait for it to answer
            self._call.cancel()
        self._reader.join(timeout_s)
        self.channel.close()
