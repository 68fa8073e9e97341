"""Lazy safetensors reading from single-file and sharded checkpoints."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from specd.models.weights import (WeightsNotFoundError, iter_tensors, load_tensors, read_tensor,
                                  tensor_names)


def test_single_and_sharded_agree(checkpoint):
    single, sharded = checkpoint("qwen3"), checkpoint("qwen3", sharded=True)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert sorted(tensor_names(single)) == sorted(tensor_names(sharded))
    a = dict(iter_tensors(single))
    for name, tensor in iter_tensors(sharded):
        assert torch.equal(tensor, a[name]), name
    embed = read_tensor(sharded, "model.embed_tokens.weight")
    assert embed.shape == (256, 64) and torch.equal(embed, a["model.embed_tokens.weight"])


def test_prefix_and_names(checkpoint):
    path = checkpoint("llama", sharded=True)
    layer1 = load_tensors(path, "model.layers.1.")
    assert layer1 and all(n.startswith("model.layers.1.") for n in layer1)
    assert "model.layers.1.self_attn.q_proj.weight" in layer1
    two = load_tensors(path, ["model.norm.weight", "lm_head.weight"])
    assert set(two) == {"model.norm.weight", "lm_head.weight"}
    assert [n for n, _ in iter_tensors(path, prefix="model.norm")] == ["model.norm.weight"]
    with pytest.raises(KeyError, match="nope"):
        read_tensor(path, "nope")
    with pytest.raises(KeyError, match="nope"):
        load_tensors(path, ["model.norm.weight", "nope"])


def test_other_file_names_and_missing(tmp_path):
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(tmp_path / "consolidated.safetensors"))
    assert torch.equal(read_tensor(tmp_path, "b"), torch.zeros(3))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsNotFoundError, match="no safetensors weights"):
        read_tensor(empty, "a")
