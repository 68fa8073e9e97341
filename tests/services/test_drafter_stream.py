"""DrafterStream's send handoff on the gRPC stream: send() returns once gRPC's sender thread holds
the step (a real n-gram drafter service over loopback gRPC, the fast socket path turned off)."""

from __future__ import annotations

import time

from specd import settings
from specd.clients.drafter_stream import DrafterStream

FAST_PATH_ENV = settings.DRAFTER_FAST_PATH.name
from specd.v1 import drafter_pb2


def test_send_returns_once_the_sender_thread_holds_the_step(monkeypatch, ngram_drafter):
    monkeypatch.setenv(FAST_PATH_ENV, "0")
    # A long handoff bound: the wait must end on the sender thread's signal, not on the timeout.
    stream = DrafterStream(ngram_drafter.address, connect_timeout_s=10.0, handoff_s=30.0)
    try:
        assert not stream.fast
        for step in range(5):
            message = drafter_pb2.DraftStepRequest()
            if step == 0:
                message.open.add(seq_id=1)
            message.sequences.add(seq_id=1, new_token_ids=[5, 6, 5, 6, 5], num_draft_tokens=3)
            t0 = time.perf_counter()
            stream.send(message)
            assert time.perf_counter() - t0 < 5.0
            assert step in stream._grpc.left_at  # taken by gRPC's sender thread before send returned
            answer = stream.receive(step, time.monotonic() + 10.0)
            assert answer.step_id == step and [s.seq_id for s in answer.sequences] == [1]
            assert stream.last_left_at <= stream.last_arrived_at
    finally:
        stream.shutdown()
