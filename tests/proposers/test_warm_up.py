"""warm_up (specd/proposers/warm_up.py): the drafter's load-time steps leave no trace.

A warmed-up proposer drafts exactly what a fresh one drafts for the same steps, holds no sequence
and, for draft_model, has every KV block back. With the heads' fixed shapes (the CUDA-graph path,
run eagerly on CPU) the warm-up creates the layouts serving starts with.
"""

from __future__ import annotations

import pytest
import torch

from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.proposers.base import DraftRequest
from specd.proposers.eagle3 import Eagle3Proposer, target_text_config
from specd.proposers.factory import build_proposer
from specd.proposers.warm_up import WARM_UP_SEQ_ID, warm_up
from specd.sampling_params import SamplingParams

K = 3
METHODS = {  # method -> (target checkpoint, draft checkpoint or None)
    "eagle3": ("target-llama", "draft-eagle3"),
    "draft_model": ("target-llama", "draft-llama-small"),
    "deepseek_mtp": ("target-deepseek-mtp", None),
    "qwen3_5_mtp": ("target-qwen3_5-mtp", None),
    "ngram": ("target-llama", None),
}


def make(tiny_models, method):
    target_name, draft_name = METHODS[method]
    target = tiny_models[target_name]
    spec = SpeculativeConfig(method=method, num_speculative_tokens=K,
                             model=str(tiny_models[draft_name]) if draft_name else "")
    text = target_text_config(target)
    config = PytorchEngineConfig(block_size=8, device_type="cpu")
    proposer = build_proposer(spec, target, int(text["vocab_size"]), config,
                              torch.device("cpu"), torch.float32)
    width = {"none": 0, "final": 1, "aux": len(getattr(proposer, "aux_layer_ids", None) or [])}[proposer.hidden_kind]
    return proposer, width * int(text["hidden_size"])


def serve(proposer, width: int, seed: int = 0) -> list[list[int]]:
    """Two sequences over three steps (prompt, then accepted-looking commits); their drafts."""
    gen = torch.Generator().manual_seed(seed)
    takes_rows = proposer.hidden_kind != "none"
    for seq_id in (0, 1):
        proposer.open(seq_id, SamplingParams(max_new_tokens=64))
    drafts, lens = [], {0: 9, 1: 4}
    for step in range(3):
        requests = []
        for seq_id, n in lens.items():
            tokens = torch.randint(4, 200, (n if step == 0 else 2,), generator=gen).tolist()
            rows = len(tokens) - (1 if step == 0 else 0)
            requests.append(DraftRequest(seq_id, tokens, torch.randn(rows, width, generator=gen) if takes_rows else None,
                                         K, num_output_tokens=1 + 2 * step))
        drafts += [p.token_ids.tolist() for p in proposer.propose(requests)]
    for seq_id in (0, 1):
        proposer.close(seq_id)
    return drafts


@pytest.mark.parametrize("method", list(METHODS))
def test_warmed_up_drafts_equal_fresh(tiny_models, method):
    warmed, width = make(tiny_models, method)
    free_before = warmed.runner.kv_cache.allocator.num_free_blocks if method == "draft_model" else None
    seconds = warm_up(warmed, hidden_width=width, num_draft_tokens=K)
    assert (seconds == 0.0) == (method == "ngram")
    if method == "draft_model":
        assert warmed.runner.kv_cache.allocator.num_free_blocks == free_before
        assert WARM_UP_SEQ_ID not in warmed._history
    if method in ("eagle3", "deepseek_mtp", "qwen3_5_mtp"):
        assert not warmed._seqs
    fresh, _ = make(tiny_models, method)
    assert serve(warmed, width) == serve(fresh, width)


def test_warm_up_creates_the_head_layouts(tiny_models):
    """On the fixed-shape path the prompt, the k single-token steps and the catch-up each have a
    layout once warm_up returns (on CUDA: captured graphs)."""
    proposer = Eagle3Proposer(tiny_models["draft-eagle3"], tiny_models["target-llama"], static_steps=True)
    width = len(proposer.aux_layer_ids) * target_text_config(tiny_models["target-llama"])["hidden_size"]
    warm_up(proposer, hidden_width=width, num_draft_tokens=K)
    qlens = {qlen for (_, qlen, _) in proposer.graphs._layouts}
    assert {1, 4} <= qlens and proposer.graphs.num_static_forwards >= 2 * K
    assert not proposer._seqs


def test_warm_up_rejects_bad_arguments(tiny_models):
    proposer, width = make(tiny_models, "eagle3")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        warm_up(proposer, hidden_width=width, num_draft_tokens=0)
    with pytest.raises(ValueError, match="hidden_width"):
        warm_up(proposer, hidden_width=0, num_draft_tokens=K)
