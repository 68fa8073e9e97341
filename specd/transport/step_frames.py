"""DraftSteps messages framed over a plain socket: the drafter's fast step path.

Why not gRPC for this one hop: a drafter round trip on gRPC's Python stream passes ~6 threads
(the verifier's sender, channel and reader threads, the drafter's poller and handler, each needing
its process's GIL) that slept through the device's step, and on the H200 VM that cost 0.65-1.40 ms
a step (BENCHMARKS.md, runs 41-44). On a socket the engine thread writes the request itself and
reads the answer itself: the drafter's one serving thread wakes, nothing else does. gRPC stays the
control plane (Info, health, reflection), the path under TLS and the fallback; the messages are the
same protos (proto/specd/v1/drafter.proto, `fast_step_port`).

A frame is kind (u8) and payload length (u32, big-endian), then the payload: MESSAGE carries a
serialized DraftStepRequest / DraftStepResponse, ERROR a u32 gRPC status code and a UTF-8 message
(the step was refused; the stream ends, as a gRPC stream ends with that status).

SPECD_STEP_SPIN_US=N (both ends: the drafter waiting for a step, the verifier for its answer):
poll the socket for up to N us before blocking on it (`spin_seconds`, `wait_readable`). Why: a
thread blocked between steps is woken by the kernel when its bytes arrive (on a VM, an idle vCPU
halts, and the host must run it again first) and then runs from cold caches. Spinning costs the
waiting thread's core; off (0) by default.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time

import grpc

MESSAGE, ERROR = 0, 1
HEADER = struct.Struct(">BI")
CODE = struct.Struct(">I")
MAX_FRAME_BYTES = 256 << 20  # as the gRPC servers' message limit
STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
SPIN_ENV = "SPECD_STEP_SPIN_US"


def spin_seconds() -> float:
    """SPECD_STEP_SPIN_US in seconds (0 when unset: block at once); validated."""
    value = os.environ.get(SPIN_ENV) or "0"
    try:
        spin_us = float(value)
    except ValueError:
        spin_us = float("nan")
    if not 0 <= spin_us < float("inf"):
        raise ValueError(f"{SPIN_ENV}: expected microseconds, a number >= 0, got {value!r}")
    return spin_us / 1e6


def wait_readable(sock: socket.socket, spin_s: float) -> bool:
    """Poll sock until it has bytes (or its peer closed, or it failed) or spin_s passes; whether
    it became readable. Each poll is a syscall that releases the GIL: other threads still run."""
    poller = select.poll()  # (select.select fails on descriptors past 1023)
    poller.register(sock, select.POLLIN)
    deadline = time.perf_counter() + spin_s
    while True:
        if poller.poll(0):  # POLLIN, or POLLHUP / POLLERR: the read that follows says which
            return True
        if time.perf_counter() >= deadline:
            return False


class FrameError(ConnectionError):
    """The peer closed mid-frame or sent something that is not a frame."""


def send_message(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(HEADER.pack(MESSAGE, len(payload)) + payload)


def send_error(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
    payload = CODE.pack(code.value[0]) + message.encode()
    sock.sendall(HEADER.pack(ERROR, len(payload)) + payload)


def parse_error(payload: bytes) -> tuple[grpc.StatusCode, str]:
    (value,) = CODE.unpack_from(payload)
    return STATUS_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN), payload[CODE.size:].decode(errors="replace")


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """The next frame (kind, payload); None when the peer closed between frames. Blocks under the
    socket's own timeout (socket.timeout past it)."""
    header = _read_exact(sock, HEADER.size, at_boundary=True)
    if header is None:
        return None
    kind, length = HEADER.unpack(header)
    if kind not in (MESSAGE, ERROR) or length > MAX_FRAME_BYTES:
        raise FrameError(f"not a step frame (kind {kind}, {length} bytes)")
    return kind, _read_exact(sock, length) if length else b""


def _read_exact(sock: socket.socket, n: int, at_boundary: bool = False) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and at_boundary:
                return None
            raise FrameError(f"the peer closed after {got} of {n} bytes")
        got += k
    return bytes(buf)
