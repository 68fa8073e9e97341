"""What RemoteProposer sends and where, without a server: the tensor codec round-trips every dtype
exactly and rejects bad messages, sampling parameters survive the wire, and the hash ring moves
only the keys a new drafter takes.
"""

from __future__ import annotations

import pytest
import torch

from services.drafter.servicer import sampling_params_from_pb
from specd.clients.draft_step import sampling_params_to_pb
from specd.clients.membership import HashRing
from specd.sampling_params import SamplingParams
from specd.transport.tensor_codec import (TensorCodecError, tensor_bytes, tensor_from_buffer, tensor_from_pb,
                                         tensor_meta_to_pb, tensor_to_pb)
from specd.v1 import common_pb2


def test_hash_ring_is_stable_under_membership_changes():
    nodes = ["10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"]
    ring = HashRing(nodes)
    before = {k: ring.lookup(k) for k in range(3000)}
    assert set(before.values()) == set(nodes)
    ring.add("10.0.0.4:50061")
    after = {k: ring.lookup(k) for k in before}
    moved = [k for k in before if before[k] != after[k]]
    assert all(after[k] == "10.0.0.4:50061" for k in moved)  # only keys the new node takes move
    assert 0.1 < len(moved) / len(before) < 0.4
    ring.remove("10.0.0.4:50061")
    assert {k: ring.lookup(k) for k in before} == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.bool])
def test_tensor_codec_round_trip_is_exact(dtype):
    source = torch.randn(5, 7) * 1000
    t = source.to(dtype) if dtype != torch.bool else source > 0
    for case in (t, t.t(), t[1:3, ::2], t[0, 0], t[:0]):  # non-contiguous, 0-d, empty
        wire = common_pb2.Tensor.FromString(tensor_to_pb(case).SerializeToString())
        back = tensor_from_pb(wire)
        assert back.dtype == case.dtype and back.shape == case.shape and torch.equal(back, case)
        assert len(wire.data) == case.numel() * case.element_size()
        copied = tensor_from_pb(wire, copy=True)
        assert torch.equal(copied, case)
        # attached: the message names dtype and shape, the bytes travel apart (step_frames.ROWS)
        meta = tensor_meta_to_pb(case, common_pb2.Tensor())
        assert not meta.data and torch.equal(tensor_from_buffer(meta, bytearray(tensor_bytes(case))), case)


def test_tensor_codec_rejects_bad_messages():
    with pytest.raises(TensorCodecError, match="cannot send"):
        tensor_to_pb(torch.zeros(2, dtype=torch.float64))
    msg = tensor_to_pb(torch.zeros(2, 3))
    msg.shape[:] = [2, 4]
    with pytest.raises(TensorCodecError, match="24 bytes"):
        tensor_from_pb(msg)
    with pytest.raises(TensorCodecError, match="dtype"):
        tensor_from_pb(common_pb2.Tensor(dtype=common_pb2.DTYPE_UNSPECIFIED))


def test_sampling_params_survive_the_wire():
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                            seed=2**62 + 5)
    back = sampling_params_from_pb(common_pb2.SamplingParameters.FromString(
        sampling_params_to_pb(params).SerializeToString()))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):  # float32 on the wire
        assert torch.tensor(getattr(back, name)).float() == torch.tensor(getattr(params, name)).float()
    assert (back.top_k, back.seed) == (params.top_k, params.seed)
    assert sampling_params_from_pb(common_pb2.SamplingParameters()).top_p == 1.0


def test_step_request_sends_one_rows_tensor_where_it_can():
    from specd.proposers.base import DraftRequest
    from specd.clients.draft_step import draft_step_request

    rows = [torch.randn(3, 8), None, torch.randn(1, 8)]
    requests = [DraftRequest(i, [1, 2, 3], r, 2) for i, r in enumerate(rows)]
    one = draft_step_request(requests, opens={}, closes=[4], with_hidden=True, hidden_dtype=torch.bfloat16)
    assert one.HasField("hidden_states") and list(one.close) == [4]
    assert torch.equal(tensor_from_pb(one.hidden_states), torch.cat([rows[0], rows[2]]).bfloat16())
    assert [s.num_hidden_rows for s in one.sequences] == [3, 0, 1]
    assert not any(s.HasField("new_hidden_states") for s in one.sequences)
    # a drafter that does not read the step's tensor, or rows of unlike widths: one tensor a sequence
    unlike = requests[:2] + [DraftRequest(2, [1], torch.randn(1, 4), 2)]
    for message in (draft_step_request(requests, opens={}, closes=[], with_hidden=True, one_tensor=False),
                    draft_step_request(unlike, opens={}, closes=[], with_hidden=True)):
        assert not message.HasField("hidden_states")
        assert [s.HasField("new_hidden_states") for s in message.sequences] == [True, False, True]
        assert torch.equal(tensor_from_pb(message.sequences[0].new_hidden_states), rows[0])
    none = draft_step_request(requests, opens={}, closes=[], with_hidden=False)
    assert not none.HasField("hidden_states") and not any(s.HasField("new_hidden_states") for s in none.sequences)


def test_rows_back_to_back_join_without_a_copy():
    from specd.clients.draft_step import joined_rows

    whole = torch.randn(6, 4)
    parts = list(whole.split([2, 0, 3, 1]))
    view = joined_rows(parts)
    assert torch.equal(view, whole) and view.data_ptr() == whole.data_ptr()  # no copy
    assert torch.equal(joined_rows(parts[2:]), whole[2:]) and joined_rows(parts[2:]).data_ptr() == whole[2:].data_ptr()
    gapped = [whole[:2], whole[3:]]  # a row left out between them: copied
    assert torch.equal(joined_rows(gapped), torch.cat(gapped)) and joined_rows(gapped).data_ptr() != whole.data_ptr()
    apart = [torch.randn(2, 4), torch.randn(1, 4)]
    assert torch.equal(joined_rows(apart), torch.cat(apart))
    assert torch.equal(joined_rows([whole[4:], whole[:4]]), torch.cat([whole[4:], whole[:4]]))  # out of order
