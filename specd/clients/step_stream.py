"""One long-lived step RPC over sync gRPC, as both services serve it (services/common/step_streams.py):
a request queue feeds the call, a reader thread drains the answers, so a step can wait for its
answer with a deadline. One answer per request, in order; a stream that fails once is dead (the
service drops the stream's sequences when it ends), and its owner opens a new one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from specd.clients.errors import RemoteServiceError


class GrpcStepStream:
    """One step call: `open_call(requests)` starts it (e.g. stub.DraftSteps), `errors` is the
    service's error family (DrafterError, GrammarServiceError). Step ids are the caller's."""

    def __init__(self, open_call: Callable[[Iterator], object], address: str,
                 errors: type[RemoteServiceError]) -> None:
        self.address = address
        self._errors = errors
        self._requests: queue.SimpleQueue = queue.SimpleQueue()  # None half-closes the stream
        self._responses: queue.SimpleQueue = queue.SimpleQueue()  # (response, arrived at) or an error
        self.left_at: dict[int, float] = {}  # step id -> when gRPC's sender thread took it
        self._taken = threading.Event()  # set when the sender thread takes a step (send() may wait on it)
        self._call = open_call(self._outgoing())
        self._reader = threading.Thread(target=self._read, name=f"{errors.service}-{address}", daemon=True)
        self._reader.start()

    def _outgoing(self):
        """The request stream as gRPC's sender thread pulls it (None half-closes it)."""
        while (message := self._requests.get()) is not None:
            self.left_at[message.step_id] = time.perf_counter()
            self._taken.set()
            yield message

    def _read(self) -> None:
        try:
            for response in self._call:
                self._responses.put((response, time.perf_counter()))
            self._responses.put(self._errors.unavailable(self.address, "the stream ended"))
        except grpc.RpcError as err:
            self._responses.put(self._errors.from_rpc(self.address, err))

    def send(self, message, handoff_s: float = 0.0) -> None:
        """Queue a step (its step_id set). handoff_s > 0: wait up to that long until gRPC's sender
        thread has taken it; blocking here releases the GIL to that thread, which serialises the
        step and hands it to gRPC's core before this thread resumes (else it waits for the GIL
        while the caller works on)."""
        self._taken.clear()
        self._requests.put(message)
        if handoff_s > 0:
            self._taken.wait(handoff_s)

    def receive(self, step_id: int, deadline: float):
        """(answer to step_id, when its request left, when the answer arrived; perf_counter), by
        `deadline` (time.monotonic()); raises the service's error and cancels the call on failure."""
        try:
            item = self._responses.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            item = self._errors.unavailable(self.address, f"no answer to step {step_id} within the deadline",
                                            grpc.StatusCode.DEADLINE_EXCEEDED)
        if not isinstance(item, RemoteServiceError):
            response, arrived = item
            left = self.left_at.pop(response.step_id, arrived)
            if response.step_id == step_id:
                return response, left, arrived
            item = self._errors(self.address, f"answered step {response.step_id}, expected {step_id}")
        self._call.cancel()
        raise item

    def shutdown(self, timeout_s: float = 1.0, hung: bool = False) -> None:
        """Half-close (the service drops this stream's sequences) and wait up to timeout_s for the
        reader; hung: a dead peer, cancelled at once rather than waited for."""
        self._requests.put(None)
        if hung:
            self._call.cancel()
        self._reader.join(timeout_s)
        self._call.cancel()
