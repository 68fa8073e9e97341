"""DraftSteps over plain framed sockets (specd/transport/step_frames.py): the drafter's fast path.

The same DrafterServicer serves it: a connection is a stream (open_stream), each frame one step
(`_step`, the same validation and locking as the gRPC stream's), a refused step an error frame with
the gRPC status the stream would have ended with, and the stream's sequences close when the
connection does, however it ends. One thread per connection, as sync gRPC holds one per stream.
Plaintext only: a drafter serving TLS does not start it (the verifier then stays on gRPC).
"""

from __future__ import annotations

import logging
import socket
import threading

import grpc

from services.drafter.servicer import DrafterServicer, _status_of
from specd.transport import step_frames
from specd.v1 import drafter_pb2

logger = logging.getLogger(__name__)


class FastStepServer:
    """Accepts step connections on host:port (0: any free port) until stop()."""

    def __init__(self, servicer: DrafterServicer, host: str = "0.0.0.0", port: int = 0) -> None:
        self.servicer = servicer
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host.strip("[]"), port), family=family)
        self.port = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._accept, name="drafter-fast-accept", daemon=True)
        self._thread.start()
        servicer.fast_step_port = self.port

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:  # closed by stop()
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, f"fast:{peer[0]}:{peer[1]}"),
                             name="drafter-fast-stream", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        stream = self.servicer.open_stream(peer)
        reason = "end"
        try:
            while (frame := step_frames.read_frame(conn)) is not None:
                kind, payload = frame
                if kind not in (step_frames.MESSAGE, step_frames.ROWS):
                    raise step_frames.FrameError("a verifier sends requests only")
                rows = None
                if kind == step_frames.ROWS:  # the step's hidden rows beside the message, read in place
                    payload, rows = step_frames.split_rows(payload)
                try:
                    request = drafter_pb2.DraftStepRequest.FromString(payload)
                    response = self.servicer._step(stream, request, attached_rows=rows)
                except Exception as exc:  # noqa: BLE001 - a refused step ends this stream, not the server
                    code, message = _status_of(exc)
                    if code == grpc.StatusCode.INTERNAL:
                        logger.exception("stream %d: step failed", stream.stream_id)
                    reason = f"error:{code.name}"
                    step_frames.send_error(conn, code, message)
                    return
                step_frames.send_message(conn, response.SerializeToString())
        except OSError as exc:  # the verifier went away (or sent garbage): its sequences go with it
            reason = f"connection:{type(exc).__name__}"
        finally:
            self.servicer._close_stream(stream, reason)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def stop(self) -> None:
        """Stop accepting and end every connection (their streams close their sequences)."""
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        try:  # wakes the accept() blocked in the other thread (close alone does not, on Linux)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(2)
