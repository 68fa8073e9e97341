"""One drafter connection: channel, Info, and the DraftSteps stream.

Where the drafter advertises a fast step port (Info.fast_step_port) and the channel is not on TLS,
the steps go over a plain socket with the same messages (specd/transport/step_frames.py): the
engine thread writes each request and reads each answer itself, with the deadline as the socket's
timeout, and no other thread of this process is involved. Otherwise (or with SPECD_DRAFTER_FAST_PATH=0,
or when the port cannot be reached) the gRPC stream carries them (specd/clients/step_stream.py),
and send() waits (up to `handoff_s`) until gRPC's sender thread has taken the step: left alone,
that thread waits for the GIL while the engine thread runs its commit and emit. A stream that
fails once is dead (`error` is set): the drafter drops a stream's sequences when it ends, so the
owner (RemoteProposer) starts a new one.
"""

from __future__ import annotations

import logging
import socket
import time

import grpc
import torch
from google.protobuf.message import DecodeError

from specd import settings
from specd.clients.channel import open_channel
from specd.clients.errors import DrafterError, DrafterUnavailableError
from specd.clients.step_stream import GrpcStepStream
from specd.sampling_params import SamplingParams
from specd.transport import step_frames
from specd.transport.tensor_codec import tensor_bytes, tensor_to_pb
from specd.v1 import drafter_pb2, drafter_pb2_grpc

logger = logging.getLogger(__name__)

# How long send() waits for gRPC's sender thread to take a step (seconds). A wait that times out
# is harmless: the step still goes.
SEND_HANDOFF_S = 0.002


class DrafterStream:
    """One drafter: channel, Info, the DraftSteps stream and the open/close ops not yet sent."""

    def __init__(self, address: str, connect_timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None, handoff_s: float = SEND_HANDOFF_S,
                 send_timeout_s: float | None = None) -> None:
        """send_timeout_s bounds a fast-path write (default connect_timeout_s): a drafter stuck in a
        step stops reading, and a large step (hidden rows) would otherwise block the engine thread
        past the step's deadline once the socket's buffer is full."""
        self.address = address
        self.send_timeout_s = connect_timeout_s if send_timeout_s is None else send_timeout_s
        self.handoff_s = handoff_s
        self.channel = open_channel(address, credentials)
        stub = drafter_pb2_grpc.DrafterStub(self.channel)
        try:  # wait_for_ready: a drafter still starting up is waited for, up to the timeout
            self.info = stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=connect_timeout_s,
                                  wait_for_ready=True)
        except grpc.RpcError as err:
            self.channel.close()
            raise DrafterUnavailableError(address, f"Info failed: {err.code().name}: {err.details()}",
                                          err.code()) from None
        self._left_at: dict[int, float] = {}  # fast path: step id -> when it was written
        self._sock = None if credentials is not None else self._connect_fast(connect_timeout_s)
        self._send_error: DrafterError | None = None  # a socket write that failed, raised by receive()
        self._grpc = GrpcStepStream(stub.DraftSteps, address, DrafterError) if self._sock is None else None
        self.pending_open: dict[int, tuple[SamplingParams, object]] = {}  # seq -> (params, grammar)
        self.pending_close: list[int] = []
        self.next_step_id = 0
        self.error: DrafterError | None = None  # set once: the stream is dead after it
        # the last received step: when its request left the queue, and when its answer arrived
        # (perf_counter; the round trip's split, RemoteProposer.last_round_trip)
        self.last_left_at = self.last_arrived_at = 0.0

    @property
    def fast(self) -> bool:
        """Whether the steps go over the fast socket path (else the gRPC stream)."""
        return self._sock is not None

    def _connect_fast(self, timeout_s: float) -> socket.socket | None:
        port = self.info.fast_step_port
        if not port or not settings.DRAFTER_FAST_PATH.get():
            return None
        host = self.address.rpartition(":")[0].strip("[]")
        try:
            sock = socket.create_connection((host, port), timeout=min(timeout_s, 5.0))
        except OSError as err:
            logger.warning("drafter %s: fast step port %d unreachable (%s); steps go over gRPC",
                           self.address, port, err)
            return None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    @property
    def takes_attached_rows(self) -> bool:
        """Whether send() may be given the step's rows apart (the fast path, to a drafter that reads them)."""
        return self._sock is not None and self.info.takes_attached_rows

    def send(self, message: drafter_pb2.DraftStepRequest, rows: torch.Tensor | None = None) -> None:
        """Queue a step. rows: hidden_states' data, kept out of the message (which holds their
        dtype and shape, tensor_meta_to_pb) and written from their own memory; only where
        takes_attached_rows, else they go into the message."""
        message.step_id = self.next_step_id
        self.next_step_id += 1
        if rows is not None and not self.takes_attached_rows:
            tensor_to_pb(rows, message.hidden_states)
            rows = None
        if self._sock is not None:
            if self._send_error is None:
                self._left_at[message.step_id] = time.perf_counter()
                try:
                    self._sock.settimeout(self.send_timeout_s)
                    if rows is None:
                        step_frames.send_message(self._sock, message.SerializeToString())
                    else:
                        step_frames.send_with_rows(self._sock, message.SerializeToString(), tensor_bytes(rows))
                except OSError as err:
                    self._send_error = DrafterUnavailableError(self.address, f"fast step path: send failed: {err}")
            return
        self._grpc.send(message, self.handoff_s)

    def probe(self, timeout_s: float) -> None:
        """One empty step, answered within timeout_s (raises DrafterError otherwise): the drafter
        serves steps, not only Info."""
        self.send(drafter_pb2.DraftStepRequest())
        self.receive(self.next_step_id - 1, time.monotonic() + timeout_s)

    def receive(self, step_id: int, deadline: float) -> drafter_pb2.DraftStepResponse:
        """The answer to step_id, by `deadline` (time.monotonic()); marks the stream dead on failure."""
        if self._sock is not None:
            return self._receive_fast(step_id, deadline)
        try:
            response, self.last_left_at, self.last_arrived_at = self._grpc.receive(step_id, deadline)
        except DrafterError as err:
            self.error = err
            raise
        return response

    def _receive_fast(self, step_id: int, deadline: float) -> drafter_pb2.DraftStepResponse:
        error = self._send_error
        if error is None:
            try:
                self._sock.settimeout(max(1e-4, deadline - time.monotonic()))
                frame = step_frames.read_frame(self._sock)
                arrived = time.perf_counter()
                if frame is None:
                    error = DrafterUnavailableError(self.address, "the drafter ended the stream")
                elif frame[0] == step_frames.ERROR:
                    error = DrafterError.from_status(self.address, *step_frames.parse_error(frame[1]))
                elif frame[0] != step_frames.MESSAGE:
                    error = DrafterError(self.address, f"fast step path: a frame of kind {frame[0]} for an answer")
                else:
                    response = drafter_pb2.DraftStepResponse.FromString(frame[1])
                    if response.step_id == step_id:
                        self.last_arrived_at = arrived
                        self.last_left_at = self._left_at.pop(step_id, arrived)
                        return response
                    error = DrafterError(self.address, f"answered step {response.step_id}, expected {step_id}")
            except socket.timeout:
                error = DrafterUnavailableError(self.address, f"no answer to step {step_id} within the deadline",
                                                grpc.StatusCode.DEADLINE_EXCEEDED)
            except (OSError, DecodeError) as err:  # a broken connection, or bytes that are no response
                error = DrafterUnavailableError(self.address, f"fast step path: {type(err).__name__}: {err}")
        self.error = error
        self._sock.close()  # a dead stream: the drafter closes its sequences when it sees the end
        raise error

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Half-close (the drafter drops this stream's sequences), then close the channel."""
        if self._sock is not None:
            self._sock.close()
            self.channel.close()
            return
        self._grpc.shutdown(timeout_s, hung=self.error is not None)  # a dead drafter is not waited for
        self.channel.close()
