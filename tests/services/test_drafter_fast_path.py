"""The drafter's fast step path: DraftSteps over framed sockets (services/drafter/fast_steps.py,
specd/transport/step_frames.py), against a real n-gram drafter service on loopback."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch

from services.drafter.server import load_drafter, start_server
from services.drafter.servicer import DrafterServicer
from specd.messages import SpeculativeConfig
from specd import settings
from specd.clients.drafter_stream import DrafterStream

FAST_PATH_ENV = settings.DRAFTER_FAST_PATH.name
from specd.clients.errors import DrafterRejectedError, DrafterUnavailableError
from specd.transport import step_frames
from specd.transport.tensor_codec import tensor_meta_to_pb
from specd.v1 import drafter_pb2
from tests.services.test_drafter import SlowProposer


def _steps(stream: DrafterStream, seq_id: int) -> list[list[int]]:
    """Five steps of one sequence whose history repeats (the n-gram drafter finds continuations)."""
    drafts = []
    for step, tokens in enumerate([[5, 6, 7, 5, 6], [7], [5, 6], [7, 5], [6]]):
        message = drafter_pb2.DraftStepRequest()
        if step == 0:
            message.open.add(seq_id=seq_id)
        message.sequences.add(seq_id=seq_id, new_token_ids=tokens, num_draft_tokens=4)
        stream.send(message)
        answer = stream.receive(step, time.monotonic() + 10.0)
        assert answer.step_id == step and stream.last_left_at <= stream.last_arrived_at
        drafts.append(list(answer.sequences[0].token_ids))
    return drafts


def _wait(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_steps_over_the_socket_answer_as_over_the_grpc_stream(monkeypatch, ngram_drafter):
    assert ngram_drafter.servicer.fast_step_port > 0
    fast = DrafterStream(ngram_drafter.address, connect_timeout_s=10.0)
    monkeypatch.setenv(FAST_PATH_ENV, "0")
    slow = DrafterStream(ngram_drafter.address, connect_timeout_s=10.0)
    try:
        assert fast.fast and fast.info.fast_step_port == ngram_drafter.servicer.fast_step_port
        assert not slow.fast
        got = _steps(fast, 1)
        assert got == _steps(slow, 1)  # stream-scoped ids: seq 1 on each stream
        assert any(got), got  # the n-gram drafter did draft
    finally:
        fast.shutdown()
        slow.shutdown()


def test_closing_the_connection_closes_the_streams_sequences(ngram_drafter):
    servicer = ngram_drafter.servicer
    before = servicer.num_open_sequences
    stream = DrafterStream(ngram_drafter.address, connect_timeout_s=10.0)
    _steps(stream, 7)
    assert servicer.num_open_sequences == before + 1
    stream.shutdown()
    _wait(lambda: servicer.num_open_sequences == before)


def test_a_refused_step_ends_the_stream_with_its_status(ngram_drafter):
    servicer = ngram_drafter.servicer
    streams = servicer.num_streams
    stream = DrafterStream(ngram_drafter.address, connect_timeout_s=10.0)
    message = drafter_pb2.DraftStepRequest()
    message.sequences.add(seq_id=99, new_token_ids=[1], num_draft_tokens=2)  # never opened
    stream.send(message)
    with pytest.raises(DrafterRejectedError, match="unknown seq id 99") as err:
        stream.receive(0, time.monotonic() + 10.0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and stream.error is err.value
    _wait(lambda: servicer.num_streams == streams)
    stream.shutdown()


def test_bytes_that_are_no_request_are_refused_as_invalid(ngram_drafter):
    with socket.create_connection(("127.0.0.1", ngram_drafter.servicer.fast_step_port), timeout=10) as sock:
        step_frames.send_message(sock, b"\xff\xff\xff")
        kind, payload = step_frames.read_frame(sock)
        assert kind == step_frames.ERROR
        code, message = step_frames.parse_error(payload)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "DraftStepRequest" in message
        assert step_frames.read_frame(sock) is None  # and the stream ends
    with socket.create_connection(("127.0.0.1", ngram_drafter.servicer.fast_step_port), timeout=10) as sock:
        sock.sendall(bytes([7, 0, 0, 0, 0]))  # not a frame kind: the connection is dropped
        assert step_frames.read_frame(sock) is None


def test_malformed_rows_frames_are_refused(ngram_drafter):
    """A ROWS frame whose message length overruns it is no frame (the connection is dropped);
    rows attached to a step without hidden_states (their dtype and shape) are INVALID_ARGUMENT."""
    port = ngram_drafter.servicer.fast_step_port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(step_frames.HEADER.pack(step_frames.ROWS, 6) + step_frames.LENGTH.pack(99) + b"ab")
        assert step_frames.read_frame(sock) is None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        message = drafter_pb2.DraftStepRequest(open=[drafter_pb2.OpenSequence(seq_id=1)])
        message.sequences.add(seq_id=1, new_token_ids=[5, 6], num_draft_tokens=2)
        step_frames.send_with_rows(sock, message.SerializeToString(), memoryview(bytes(8)))
        kind, payload = step_frames.read_frame(sock)
        code, text = step_frames.parse_error(payload)
        assert kind == step_frames.ERROR and code == grpc.StatusCode.INVALID_ARGUMENT and "without hidden_states" in text


def test_rows_beside_the_message_draft_as_rows_inside_it(eagle3_drafter, monkeypatch):
    """The step's rows attached to a ROWS frame (the fast path) or inside the message (gRPC, where
    DrafterStream.send folds them in): the same drafts. Attached bytes that do not fit the shape
    named in hidden_states are INVALID_ARGUMENT."""
    server = eagle3_drafter
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randn(3, server.servicer.hidden_size, generator=gen), torch.randn(2, server.servicer.hidden_size,
                                                                                    generator=gen)]

    def drafts(stream):
        out = []
        for step, (tokens, step_rows) in enumerate(zip([[5, 6, 7, 8], [9, 10]], rows)):
            message = drafter_pb2.DraftStepRequest(open=[drafter_pb2.OpenSequence(seq_id=1)] if step == 0 else [])
            message.sequences.add(seq_id=1, new_token_ids=tokens, num_draft_tokens=3, num_hidden_rows=len(step_rows))
            tensor_meta_to_pb(step_rows, message.hidden_states)
            stream.send(message, step_rows)
            out.append(list(stream.receive(step, time.monotonic() + 10).sequences[0].token_ids))
        return out
    fast = DrafterStream(server.address, connect_timeout_s=10.0)
    monkeypatch.setenv(FAST_PATH_ENV, "0")
    slow = DrafterStream(server.address, connect_timeout_s=10.0)
    try:
        assert fast.takes_attached_rows and not slow.takes_attached_rows
        attached = server.servicer.num_steps_with_attached_rows
        got = drafts(fast)
        assert server.servicer.num_steps_with_attached_rows == attached + 2
        assert got == drafts(slow) and all(len(d) == 3 for d in got)
    finally:
        fast.shutdown()
        slow.shutdown()
    with socket.create_connection(("127.0.0.1", server.servicer.fast_step_port), timeout=10) as sock:
        message = drafter_pb2.DraftStepRequest(open=[drafter_pb2.OpenSequence(seq_id=1)])
        message.sequences.add(seq_id=1, new_token_ids=[5, 6, 7, 8], num_draft_tokens=3, num_hidden_rows=3)
        tensor_meta_to_pb(rows[0], message.hidden_states)
        step_frames.send_with_rows(sock, message.SerializeToString(), memoryview(bytes(rows[0].numel() * 4 - 4)))
        kind, payload = step_frames.read_frame(sock)
        code, text = step_frames.parse_error(payload)
        assert kind == step_frames.ERROR and code == grpc.StatusCode.INVALID_ARGUMENT and "bytes for shape" in text


def test_a_missed_deadline_is_unavailable_and_kills_the_stream():
    server = start_server(DrafterServicer(SlowProposer(1.0), vocab_size=16), "127.0.0.1", 0)
    try:
        stream = DrafterStream(server.address, connect_timeout_s=10.0)
        assert stream.fast
        message = drafter_pb2.DraftStepRequest()
        message.open.add(seq_id=1)
        message.sequences.add(seq_id=1, new_token_ids=[1, 2], num_draft_tokens=2)
        t0 = time.perf_counter()
        stream.send(message)
        with pytest.raises(DrafterUnavailableError, match="within the deadline") as err:
            stream.receive(0, time.monotonic() + 0.2)
        assert time.perf_counter() - t0 < 0.9 and err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(DrafterUnavailableError):
            stream.probe(5.0)  # dead once failed: a new stream is needed
        fresh = DrafterStream(server.address, connect_timeout_s=10.0)
        fresh.probe(5.0)  # answers once the slow step is over
        fresh.shutdown()
    finally:
        server.stop(0)


def test_a_drafter_without_the_fast_port_and_an_unreachable_port_both_mean_grpc(tiny_models, monkeypatch):
    target = tiny_models["target-llama"]
    servicer = load_drafter(target, SpeculativeConfig(method="ngram", num_speculative_tokens=3), target)
    server = start_server(servicer, "127.0.0.1", 0, fast_step_port=-1)
    try:
        stream = DrafterStream(server.address, connect_timeout_s=10.0)
        assert stream.info.fast_step_port == 0 and not stream.fast
        stream.probe(10.0)
        stream.shutdown()
        with socket.socket() as unused:  # a port nobody listens on
            unused.bind(("127.0.0.1", 0))
            servicer.fast_step_port = unused.getsockname()[1]
            stream = DrafterStream(server.address, connect_timeout_s=10.0)
        assert stream.info.fast_step_port == servicer.fast_step_port and not stream.fast
        stream.probe(10.0)
        stream.shutdown()
    finally:
        server.stop(0)


def test_a_write_to_a_drafter_that_stopped_reading_is_bounded(ngram_drafter):
    """A drafter stuck in a step reads nothing: a large step must not block the engine thread
    past send_timeout_s once the socket's buffers are full."""
    stream = DrafterStream(ngram_drafter.address, connect_timeout_s=10.0, send_timeout_s=0.2)
    with socket.create_server(("127.0.0.1", 0)) as deaf:  # accepts, never reads
        stream._sock.close()
        stream._sock = socket.create_connection(deaf.getsockname(), timeout=5)
        message = drafter_pb2.DraftStepRequest()
        message.open.add(seq_id=1)
        message.sequences.add(seq_id=1, new_token_ids=list(range(1 << 22)), num_draft_tokens=2)  # ~16 MB
        t0 = time.perf_counter()
        stream.send(message)
        assert time.perf_counter() - t0 < 3.0
        with pytest.raises(DrafterUnavailableError, match="send failed"):
            stream.receive(0, time.monotonic() + 10.0)
    stream.shutdown()


def test_stopping_the_drafter_is_prompt_and_closes_the_fast_port():
    server = start_server(DrafterServicer(SlowProposer(0.0), vocab_size=16), "127.0.0.1", 0)
    port = server.servicer.fast_step_port
    stream = DrafterStream(server.address, connect_timeout_s=10.0)
    stream.probe(10.0)
    t0 = time.perf_counter()
    server.stop(0)
    assert time.perf_counter() - t0 < 1.0  # the accept thread is woken, not waited out
    with pytest.raises(DrafterUnavailableError):
        stream.probe(10.0)  # the open connection was ended too
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_frames_of_every_size_arrive_whole_and_in_order():
    """Small frames go out in one write, large ones (a step's hidden rows) as header and payload:
    either way the reader gets each payload exactly, frame after frame, across a real socket."""
    import os
    import socket
    import threading

    sizes = [0, 1, step_frames.ONE_WRITE_BYTES, step_frames.ONE_WRITE_BYTES + 1, 5 << 20, 17]
    payloads = [os.urandom(n) for n in sizes]
    left, right = socket.socketpair()
    with left, right:
        writer = threading.Thread(target=lambda: [step_frames.send_message(left, p) for p in payloads])
        writer.start()  # (the 5 MiB frame outgrows the socket's buffer: the reader drains it meanwhile)
        for want in payloads:
            kind, got = step_frames.read_frame(right)
            assert kind == step_frames.MESSAGE and got == want
        writer.join()
        # ROWS frames: the message and the rows' bytes, written from a tensor's memory, come apart
        rows = torch.arange(3 * 1024 * 1024, dtype=torch.float32).view(-1, 1024)  # 12 MiB
        for message in (b"", b"m" * 10, os.urandom(step_frames.ONE_WRITE_BYTES + 1)):
            writer = threading.Thread(target=step_frames.send_with_rows,
                                      args=(left, message, memoryview(rows.numpy()).cast("B")))
            writer.start()
            kind, payload = step_frames.read_frame(right)
            got_message, got_rows = step_frames.split_rows(payload)
            writer.join()
            assert kind == step_frames.ROWS and bytes(got_message) == message
            assert torch.equal(torch.frombuffer(got_rows, dtype=torch.float32).view(-1, 1024), rows)
        left.shutdown(socket.SHUT_WR)
        assert step_frames.read_frame(right) is None
