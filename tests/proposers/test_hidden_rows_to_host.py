"""hidden_rows_to_host: a batch's hidden rows in one copy, each request keeping its own."""

from __future__ import annotations

import pytest
import torch

from specd.proposers.base import DraftRequest, hidden_rows_to_host


def test_rows_split_back_per_request_in_the_wire_dtype():
    rows = [torch.randn(3, 8), None, torch.randn(1, 8), torch.randn(0, 8)]
    requests = [DraftRequest(i, [1] * 3, r, 2) for i, r in enumerate(rows)]
    out = hidden_rows_to_host(requests, torch.bfloat16)
    assert [r.seq_id for r in out] == [0, 1, 2, 3] and out[1].new_hidden_states is None
    for r, want in zip(out, rows):
        if want is not None:
            assert r.new_hidden_states.dtype == torch.bfloat16 and r.new_hidden_states.shape == want.shape
            assert torch.equal(r.new_hidden_states, want.to(torch.bfloat16))
    assert requests[0].new_hidden_states.dtype == torch.float32  # the engine's requests are left alone


def test_unlike_rows_are_left_to_the_codec():
    requests = [DraftRequest(0, [1], torch.randn(1, 8), 1), DraftRequest(1, [1], torch.randn(1, 4), 1)]
    assert hidden_rows_to_host(requests) is requests
    assert hidden_rows_to_host([DraftRequest(0, [1], None, 1)])[0].new_hidden_states is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned copy is the CUDA path")
def test_device_rows_come_back_through_pinned_memory():
    rows = [torch.randn(2, 8, device="cuda"), torch.randn(3, 8, device="cuda")]
    out = hidden_rows_to_host([DraftRequest(i, [1], r, 1) for i, r in enumerate(rows)])
    for r, want in zip(out, rows):
        assert r.new_hidden_states.device.type == "cpu" and torch.equal(r.new_hidden_states, want.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned copy is the CUDA path")
def test_a_cuda_head_takes_host_rows_through_pinned_memory(tiny_models):
    """The drafter's side: rows off the wire (host, bf16) reach a CUDA head in order, in its dtype."""
    from specd.proposers.eagle3 import Eagle3Proposer

    head = Eagle3Proposer(tiny_models["draft-eagle3"], tiny_models["target-llama"], device=torch.device("cuda"),
                          dtype=torch.float32)
    given = [torch.randn(n, 24).bfloat16() for n in (2, 1, 3)]
    got = head._rows_to_device(given)
    assert got.is_cuda and got.dtype == torch.float32
    assert torch.equal(got.cpu(), torch.cat(given).float())
