"""One drafting step as the wire's DraftStepRequest (the verifier's side of proto/specd/v1/drafter.proto).

The step's hidden rows travel as one [N, H*] tensor (`hidden_states`, each sequence naming its
`num_hidden_rows`) where the drafter says it reads that form (Info.takes_step_hidden_states) and
the rows are alike; else one tensor a sequence (`new_hidden_states`). One tensor because building,
encoding and decoding one a sequence costs about twice as much at large batches
(bench/draft_wire.py), and both ends of a step wait for it.
"""

from __future__ import annotations

import torch

from specd.proposers.base import DraftRequest
from specd.sampling_params import SamplingParams
from specd.transport.tensor_codec import tensor_meta_to_pb, tensor_to_pb
from specd.v1 import common_pb2, drafter_pb2


def sampling_params_to_pb(params: SamplingParams) -> common_pb2.SamplingParameters:
    return common_pb2.SamplingParameters(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, seed=params.seed)


def joined_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """rows ([n_i, W] each, alike) as one [sum n_i, W] tensor: a view where they lie back to back
    in one buffer, as hidden_rows_to_host leaves them (its pinned copy, split), else a copy."""
    first, width = rows[0], rows[0].shape[1]
    offset = first.storage_offset()
    for r in rows:
        if (not r.is_contiguous() or r.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or r.storage_offset() != offset):
            return torch.cat(rows)
        offset += r.shape[0] * width
    return first.as_strided((sum(r.shape[0] for r in rows), width), (width, 1))


def draft_step_request(requests: list[DraftRequest], *, opens: dict[int, tuple[SamplingParams, object]],
                       closes: list[int], with_hidden: bool, hidden_dtype: torch.dtype | None = None,
                       one_tensor: bool = True) -> drafter_pb2.DraftStepRequest:
    """The message (step_id unset) for `requests`, after closing `closes` and opening `opens` (seq
    id -> (params, grammar or None)). with_hidden: the drafter takes hidden rows (else none are
    sent); hidden_dtype: cast them to it; one_tensor: the drafter reads the step's one tensor."""
    message, rows = draft_step_parts(requests, opens=opens, closes=closes, with_hidden=with_hidden,
                                     hidden_dtype=hidden_dtype, one_tensor=one_tensor)
    if rows is not None:
        tensor_to_pb(rows, message.hidden_states)
    return message


def draft_step_parts(requests: list[DraftRequest], *, opens: dict[int, tuple[SamplingParams, object]],
                     closes: list[int], with_hidden: bool, hidden_dtype: torch.dtype | None = None,
                     one_tensor: bool = True) -> tuple[drafter_pb2.DraftStepRequest, torch.Tensor | None]:
    """draft_step_request's message with the step's one rows tensor kept apart: (the message, its
    hidden_states holding their dtype and shape only; the rows [N, H*]), or (the message, None)
    where the step has no one tensor. The rows go beside the message (step_frames.ROWS) or into
    it (tensor_to_pb)."""
    message = drafter_pb2.DraftStepRequest(close=closes)
    for seq_id, (params, grammar) in opens.items():
        message.open.add(seq_id=seq_id, params=sampling_params_to_pb(params),
                         grammar_kind=grammar.kind if grammar else "",
                         grammar_source=grammar.source if grammar else "")
    rows = [r.new_hidden_states for r in requests if r.new_hidden_states is not None] if with_hidden else []
    for hidden in rows:
        assert hidden.ndim == 2, f"new_hidden_states: must be [n, H*], got {tuple(hidden.shape)}"
    if hidden_dtype is not None:
        rows = [hidden.to(hidden_dtype) for hidden in rows]
    one_tensor = bool(rows) and one_tensor and len({(h.shape[1], h.dtype, h.device) for h in rows}) == 1
    step_rows = None
    if one_tensor:
        step_rows = joined_rows(rows)
        tensor_meta_to_pb(step_rows, message.hidden_states)
    shares = iter(rows)
    for r in requests:
        item = message.sequences.add(seq_id=r.seq_id, new_token_ids=r.new_token_ids,
                                     num_draft_tokens=r.num_draft_tokens, num_output_tokens=r.num_output_tokens)
        if r.new_hidden_states is not None and with_hidden:
            hidden = next(shares)  # [n, H*]
            if one_tensor:
                item.num_hidden_rows = hidden.shape[0]
            else:
                tensor_to_pb(hidden, item.new_hidden_states)
    return message, step_rows
