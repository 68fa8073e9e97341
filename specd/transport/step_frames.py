"""DraftSteps messages framed over a plain socket: the drafter's fast step path.

Why not gRPC for this one hop: a drafter round trip on gRPC's Python stream passes ~6 threads
(the verifier's sender, channel and reader threads, the drafter's poller and handler, each needing
its process's GIL) that slept through the device's step, and on the H200 VM that cost 0.65-1.40 ms
a step (BENCHMARKS.md, "End to end through the services (GPU)", has the transit either way). On
a socket the engine thread writes the request itself and reads the answer itself: the drafter's
one serving thread wakes, nothing else does. gRPC stays the control plane (Info, health,
reflection), the path under TLS and the fallback; the messages are the same protos
(proto/specd/v1/drafter.proto, `fast_step_port`).

A frame is kind (u8) and payload length (u32, big-endian), then the payload: MESSAGE carries a
serialized DraftStepRequest / DraftStepResponse, ERROR a u32 gRPC status code and a UTF-8 message
(the step was refused; the stream ends, as a gRPC stream ends with that status), ROWS a request
with its hidden rows attached: the message's length (u32), the message (hidden_states holding
dtype and shape only), then the rows' raw bytes, written from the tensor's own memory and read
as a view of the frame (Info.takes_attached_rows: bench/draft_wire.py measured the rows' copies
through protobuf at 8.1 ms a step for 12.6 MB).
"""

from __future__ import annotations

import socket
import struct

import grpc

MESSAGE, ERROR, ROWS = 0, 1, 2
HEADER = struct.Struct(">BI")
CODE = struct.Struct(">I")
LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 256 << 20  # as the gRPC servers' message limit
# Frames up to this size go out in one write (one packet); larger ones (a step's hidden rows: 3 MB
# at batch 128 for an 8B EAGLE-3 head, 12 MB at acceptance 4) as header and payload, since joining
# them copied the payload on the engine thread (bench/draft_wire.py on the 2-core CI machine: a 3.1
# MB frame 1.08-1.41 -> 0.74-0.80 ms to send; at 12.6 MB the reader's draining bounds both, 5.4-6.8 ms).
ONE_WRITE_BYTES = 64 << 10
STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class FrameError(ConnectionError):
    """The peer closed mid-frame or sent something that is not a frame."""


def send_message(sock: socket.socket, payload: bytes) -> None:
    header = HEADER.pack(MESSAGE, len(payload))
    if len(payload) <= ONE_WRITE_BYTES:
        sock.sendall(header + payload)
    else:
        sock.sendall(header)
        sock.sendall(payload)


def send_with_rows(sock: socket.socket, payload: bytes, rows: memoryview) -> None:
    """A ROWS frame: the message, then `rows` (bytes, format "B") written from their own memory."""
    head = HEADER.pack(ROWS, LENGTH.size + len(payload) + rows.nbytes) + LENGTH.pack(len(payload))
    if len(payload) <= ONE_WRITE_BYTES:
        sock.sendall(head + payload)
    else:
        sock.sendall(head)
        sock.sendall(payload)
    sock.sendall(rows)


def split_rows(payload: bytearray) -> tuple[memoryview, memoryview]:
    """A ROWS frame's payload -> (the message's bytes, the rows' bytes), views of it."""
    view = memoryview(payload)
    if len(view) < LENGTH.size:
        raise FrameError(f"a rows frame of {len(view)} bytes has no message length")
    (length,) = LENGTH.unpack_from(view)
    if LENGTH.size + length > len(view):
        raise FrameError(f"a rows frame's message ({length} bytes) overruns its {len(view)} bytes")
    return view[LENGTH.size:LENGTH.size + length], view[LENGTH.size + length:]


def send_error(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
    payload = CODE.pack(code.value[0]) + message.encode()
    sock.sendall(HEADER.pack(ERROR, len(payload)) + payload)


def parse_error(payload: bytes) -> tuple[grpc.StatusCode, str]:
    (value,) = CODE.unpack_from(payload)
    return STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN), payload[CODE.size:].decode(errors="replace")


def read_frame(sock: socket.socket) -> tuple[int, bytearray] | None:
    """The next frame (kind, payload); None when the peer closed between frames. Blocks under the
    socket's own timeout (socket.timeout past it). The payload is the buffer it was read into (a
    message parses from it as from bytes), not a copy."""
    header = _read_exact(sock, HEADER.size, at_boundary=True)
    if header is None:
        return None
    kind, length = HEADER.unpack(header)
    if kind not in (MESSAGE, ERROR, ROWS) or length > MAX_FRAME_BYTES:
        raise FrameError(f"not a step frame (kind {kind}, {length} bytes)")
    return kind, _read_exact(sock, length) if length else bytearray()


def _read_exact(sock: socket.socket, n: int, at_boundary: bool = False) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and at_boundary:
                return None
            raise FrameError(f"the peer closed after {got} of {n} bytes")
        got += k
    return buf
