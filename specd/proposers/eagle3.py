"""EAGLE-3 proposer: SafeAILab's draft head over the target's aux hidden states (hidden_kind "aux").

The verifier sends, per committed position, the concatenated inputs of three target decoder layers
(`aux_layer_ids`, by default 2, L // 2 and L - 3, as EAGLE-3 trained on them). The head drafts over
its reduced vocabulary; drafts and q are reported in the target vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specd.models.weights import WeightsNotFoundError, iter_tensors
from specd.proposers.eagle3_head import Eagle3Config, Eagle3Head
from specd.proposers.pair_head import PairHeadProposer, read_first_tensor

# Where the head finds the target's input embeddings when its checkpoint has none.
TARGET_EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """The target layers whose inputs EAGLE-3 reads: low, middle and high (SafeAILab's choice)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def target_text_config(target_path: str | Path) -> dict:
    """The target's config.json, or its `text_config` for multimodal checkpoints."""
    with open(Path(target_path) / "config.json", encoding="utf-8") as f:
        raw = json.load(f)
    return raw.get("text_config") or raw


def _draft_tensors(draft_path: Path) -> dict[str, torch.Tensor]:
    """All head tensors; SafeAILab publishes some heads as pytorch_model.bin only."""
    try:
        return dict(iter_tensors(draft_path))
    except WeightsNotFoundError:
        bin_path = draft_path / "pytorch_model.bin"
        if not bin_path.is_file():
            raise
        return torch.load(bin_path, map_location="cpu", weights_only=True)


def load_eagle3_head(draft_path: str | Path, target_path: str | Path
                     ) -> tuple[Eagle3Head, Eagle3Config]:
    """Build the head on CPU in float32 from the checkpoint, borrowing embeddings if absent."""
    draft_path = Path(draft_path)
    with open(draft_path / "config.json", encoding="utf-8") as f:
        cfg = Eagle3Config.from_dict(json.load(f))
    head = Eagle3Head(cfg)
    state = _draft_tensors(draft_path)
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = read_first_tensor(target_path, TARGET_EMBED_NAMES)
    state.setdefault("d2t", head.d2t)  # a head over the full vocabulary may omit the maps
    state.setdefault("t2d", head.t2d)
    expected = set(head.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise KeyError(f"EAGLE-3 checkpoint {draft_path}: missing {missing}, "
                       f"unexpected {unexpected}")
    head.load_state_dict({k: v.to(head.state_dict()[k].dtype) for k, v in state.items()})
    target_ids = torch.arange(cfg.draft_vocab_size) + head.d2t
    if not bool(head.t2d[target_ids].all()) or int(head.t2d.sum()) != cfg.draft_vocab_size:
        raise ValueError(f"EAGLE-3 checkpoint {draft_path}: d2t and t2d disagree on the "
                         "draft vocabulary")
    return head, cfg


class Eagle3Proposer(PairHeadProposer):
    """Drafts with an EAGLE-3 head; the runner must send `aux_layer_ids`' inputs as hidden rows."""

    method = "eagle3"
    hidden_kind = "aux"

    def __init__(self, draft_path: str | Path, target_path: str | Path,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 **head_options) -> None:
        head, cfg = load_eagle3_head(draft_path, target_path)
        num_layers = target_text_config(target_path)["num_hidden_layers"]
        self.aux_layer_ids = cfg.aux_layer_ids or default_aux_layer_ids(num_layers)
        self.vocab_size = cfg.vocab_size
        super().__init__(head.to(device=device, dtype=dtype), device, dtype, **head_options)
