"""The drafter wire's host cost for a step's hidden rows (EAGLE-3 at 8B: 3 x 4096 bf16 a token),
each encoding against the one before it, side by side in one run:

- codec: the step message built and serialized on the verifier, parsed and its rows decoded on the
  drafter, a tensor a sequence (`new_hidden_states`) against the step's one tensor
  (`hidden_states` + `num_hidden_rows`);
- codec, attached: the rows beside the message (step_frames.ROWS, Info.takes_attached_rows), read
  in place from the bytes that carried them (tensor_from_buffer): no protobuf copy;
- frame: a message-sized frame over loopback TCP to a reader process, header joined to the payload
  and copied again on reading, against header and payload written apart and read without the copy
  (step_frames). The sender's time is what the verifier's engine thread spends.

Why: with an EAGLE-3 drafter's hidden rows the verifier's commit (which sends the next step's
requests) costs far more at large batches than without, and both ends of a step wait for it. CPU
only; medians over --repeats.

    python -m bench.draft_wire [--batches 64,128] [--rows 1,4] [--width 12288] [--repeats 15]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import torch

from specd.proposers.base import DraftRequest
from specd.clients.draft_step import draft_step_parts, draft_step_request
from specd.transport import step_frames
from specd.transport.tensor_codec import tensor_bytes, tensor_from_buffer, tensor_from_pb
from specd.v1 import drafter_pb2


def codec_ms(requests: list[DraftRequest], one_tensor: bool, repeats: int) -> float:
    """Median ms of build + serialize + parse + decode (the rows joined, as the head takes them)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = draft_step_request(requests, opens={}, closes=[], with_hidden=True,
                                     one_tensor=one_tensor).SerializeToString()
        message = drafter_pb2.DraftStepRequest()
        message.ParseFromString(payload)
        if one_tensor:
            rows = tensor_from_pb(message.hidden_states).split([s.num_hidden_rows for s in message.sequences])
        else:
            rows = [tensor_from_pb(s.new_hidden_states) for s in message.sequences]
        torch.cat(rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def attached_codec_ms(requests: list[DraftRequest], repeats: int) -> float:
    """Median ms of codec_ms's work with the rows beside the message: the message without them
    built, serialized and parsed; the rows' bytes taken from the tensor's memory and read in place
    (on the wire the socket copies them once each way, as it copies every frame's bytes)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        message, rows = draft_step_parts(requests, opens={}, closes=[], with_hidden=True)
        payload, data = message.SerializeToString(), tensor_bytes(rows)
        parsed = drafter_pb2.DraftStepRequest()
        parsed.ParseFromString(payload)
        shares = tensor_from_buffer(parsed.hidden_states, data).split([s.num_hidden_rows for s in parsed.sequences])
        torch.cat(shares)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _old_send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(step_frames.HEADER.pack(step_frames.MESSAGE, len(payload)) + payload)


def _reader(port: int, copy: bool) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (frame := step_frames.read_frame(sock)) is not None:
        if copy:
            bytes(frame[1])  # the old read returned a copy of the buffer
        sock.sendall(b"k")


def frame_ms(size: int, old: bool, repeats: int) -> float:
    """Median ms the sender spends writing one frame of `size` bytes to a reader process."""
    listener = socket.create_server(("127.0.0.1", 0))
    reader = mp.get_context("spawn").Process(target=_reader, args=(listener.getsockname()[1], old), daemon=True)
    reader.start()
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, times = b"x" * size, []
    send = _old_send if old else step_frames.send_message
    with conn, listener:
        for _ in range(repeats):
            time.sleep(0.01)  # the reader idle, as a drafter between steps
            t0 = time.perf_counter()
            send(conn, payload)
            times.append(time.perf_counter() - t0)
            conn.recv(1)
    reader.kill()
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="64,128")
    parser.add_argument("--rows", default="1,4", help="hidden rows a sequence a step (accepted tokens + 1)")
    parser.add_argument("--width", type=int, default=3 * 4096)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print("| batch | rows a sequence | MB a step | codec: a tensor a sequence ms | one tensor ms | ratio | "
          "one tensor attached ms | one tensor / attached | "
          "frame send: joined + read copy ms | apart, no copy ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for n in (int(r) for r in args.rows.split(",")):
            whole = torch.randn(batch * n, args.width).bfloat16()
            requests = [DraftRequest(i, [1] * n, rows, 3) for i, rows in enumerate(whole.split(n))]
            size = len(draft_step_request(requests, opens={}, closes=[], with_hidden=True).SerializeToString())
            per_seq, one = codec_ms(requests, False, args.repeats), codec_ms(requests, True, args.repeats)
            attached = attached_codec_ms(requests, args.repeats)
            joined, apart = frame_ms(size, True, args.repeats), frame_ms(size, False, args.repeats)
            print(f"| {batch} | {n} | {size / 1e6:.1f} | {per_seq:.2f} | {one:.2f} | {per_seq / one:.2f}x | "
                  f"{attached:.2f} | {one / attached:.2f}x | "
                  f"{joined:.2f} | {apart:.2f} | {joined / apart:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
