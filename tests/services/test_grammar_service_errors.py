"""The grammar service's errors over real gRPC on loopback: a malformed step ends only its stream
(the server keeps serving), a rejected commit or an unknown sequence raises on the client and a fresh
stream recovers, and an unreachable service or a missed deadline raises GrammarUnavailableError;
masks that break their contract count as a failed replica.
"""

from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch

from specd.grammar.backend import GrammarSpec, GrammarStep
from specd.grammar.errors import GrammarNotOpenError
from specd.clients.errors import GrammarRejectedError, GrammarServiceError, GrammarUnavailableError
from specd.clients.grammar import RemoteGrammarBackend, spec_to_pb
from specd.transport.tensor_codec import tensor_to_pb
from specd.v1 import grammar_pb2, grammar_pb2_grpc
from tests.services.conftest import _allowed


def _raw_steps(address: str, *messages) -> list:
    with grpc.insecure_channel(address) as channel:
        return list(grammar_pb2_grpc.GrammarStub(channel).Steps(iter(messages), timeout=10))


def _open(seq_id: int, spec: GrammarSpec, replay=()) -> grammar_pb2.OpenMatcher:
    return grammar_pb2.OpenMatcher(seq_id=seq_id, spec=spec_to_pb(spec), replay_token_ids=list(replay))


@pytest.mark.parametrize("case,code,text", [
    ("unknown_seq_masks", "INVALID_ARGUMENT", "unknown seq id 7"),
    ("unknown_seq_commit", "INVALID_ARGUMENT", "unknown seq id 7"),
    ("rejected_commit", "FAILED_PRECONDITION", "not allowed"),
    ("rejected_replay", "FAILED_PRECONDITION", "not allowed"),
    ("bad_grammar", "INVALID_ARGUMENT", "invalid regex"),
    ("duplicate_open", "FAILED_PRECONDITION", "already open"),
    ("token_out_of_vocab", "INVALID_ARGUMENT", "outside [0, 512)"),
    ("negative_budget", "INVALID_ARGUMENT", "remaining_tokens -2"),
])
def test_malformed_step_ends_only_its_stream(grammar_server, case, code, text):
    spec = GrammarSpec("regex", "(yes|no)-[0-9]{2,6}")
    digit = 19  # "0": never allowed first by this regex
    first = grammar_pb2.GrammarStepRequest(step_id=0, open=[_open(1, spec)],
                                           masks=[grammar_pb2.MaskRequest(seq_id=1, draft_token_ids=[5])])
    bad = {
        "unknown_seq_masks": grammar_pb2.GrammarStepRequest(masks=[grammar_pb2.MaskRequest(seq_id=7)]),
        "unknown_seq_commit": grammar_pb2.GrammarStepRequest(commit=[grammar_pb2.CommitTokens(seq_id=7, token_ids=[5])]),
        "rejected_commit": grammar_pb2.GrammarStepRequest(commit=[grammar_pb2.CommitTokens(seq_id=1, token_ids=[digit])]),
        "rejected_replay": grammar_pb2.GrammarStepRequest(open=[_open(2, spec, [digit])]),
        "bad_grammar": grammar_pb2.GrammarStepRequest(open=[_open(2, GrammarSpec("regex", "(unclosed"))]),
        "duplicate_open": grammar_pb2.GrammarStepRequest(open=[_open(1, spec)]),
        "token_out_of_vocab": grammar_pb2.GrammarStepRequest(masks=[grammar_pb2.MaskRequest(seq_id=1, draft_token_ids=[512])]),
        "negative_budget": grammar_pb2.GrammarStepRequest(masks=[grammar_pb2.MaskRequest(seq_id=1, remaining_tokens=-2)]),
    }[case]
    bad.step_id = 1
    with pytest.raises(grpc.RpcError) as info:
        _raw_steps(grammar_server.address, first, bad)
    assert info.value.code().name == code and text in info.value.details()
    answers = _raw_steps(grammar_server.address, first)  # the server keeps serving
    assert [a.step_id for a in answers] == [0] and answers[0].masks[0].num_valid_drafts == 0


def test_client_errors_and_recovery(grammar_server):
    spec = GrammarSpec("regex", "(yes|no)-[0-9]{2,6}")
    with RemoteGrammarBackend(grammar_server.address) as remote:
        remote.open(0, spec)
        remote.open(1, spec)
        with pytest.raises(GrammarNotOpenError):
            remote.step(GrammarStep(drafts={5: []}))
        y = remote.step(GrammarStep(drafts={0: [], 1: []}))[0].bitmask[0]
        first = _allowed(y, 512)
        with pytest.raises(GrammarRejectedError) as info:
            remote.step(GrammarStep(commits={0: [19]}, drafts={0: []}))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and info.value.lost_seq_ids == [0, 1]
        assert len(remote) == 0
        remote.open(0, spec, replay_token_ids=[first[0]])  # recovery: a fresh stream
        assert remote.step(GrammarStep(drafts={0: []}))[0].bitmask.shape == (1, 16)


def test_unreachable_and_deadline_raise_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # accepts TCP but never speaks HTTP/2: every call hits the deadline
        address = f"127.0.0.1:{s.getsockname()[1]}"
        with RemoteGrammarBackend(address, deadline_s=0.5, recover_timeout_s=0) as remote:
            remote.open(0, GrammarSpec("json_object"))
            t0 = time.monotonic()
            with pytest.raises(GrammarUnavailableError, match="within") as info:
                remote.step(GrammarStep(drafts={0: []}))
            assert time.monotonic() - t0 < 3 and info.value.lost_seq_ids == [0]
            with pytest.raises(GrammarUnavailableError, match="Validate"):
                remote.validate(GrammarSpec("json_object"))


def _answer(rows: int, width: int, num_valid: int, closing: int = 0, dtype=torch.int32):
    response = grammar_pb2.GrammarStepResponse()
    response.masks.add(seq_id=1, num_valid_drafts=num_valid, num_closing_rows=closing,
                       bitmask=tensor_to_pb(torch.zeros(rows, width, dtype=dtype)))
    return response


@pytest.mark.parametrize("answer, fault", [
    (lambda: _answer(4, 16, 2), "4 bitmask rows, 2 valid drafts"),  # a row would mask the next request's
    (lambda: _answer(5, 16, 4), "4 valid drafts of 3"),
    (lambda: _answer(3, 16, 2, closing=4), "4 closing rows of 3"),
    (lambda: _answer(3, 16, 2, dtype=torch.int64), r"not \[rows, W\] int32"),
    (lambda: _answer(3, 9, 2), "bitmask width 9, not 16"),
])
def test_a_malformed_mask_answer_is_a_failed_replica(answer, fault):
    """Masks that break MaskResult's contract are never applied: the step treats the replica as
    failed (a fresh stream, the next replica), as for a lost connection."""
    backend = RemoteGrammarBackend("127.0.0.1:1")
    step = GrammarStep(commits={}, drafts={1: [7, 8, 9]}, budgets={})
    assert backend._results(_answer(3, 16, 2), step)[1].num_valid_drafts == 2  # width 16 from now on
    with pytest.raises(GrammarServiceError, match=fault):
        backend._results(answer(), step)
