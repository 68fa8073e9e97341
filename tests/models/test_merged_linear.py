"""Fused q/k/v and gate/up projections (merged_linear.py): checkpoint names, loading, sharding."""

from __future__ import annotations

import torch
from torch import nn

from specd.models.merged_linear import MergedLinear, checkpoint_tensors
from specd.models.weights import tensor_names


def _merged(bias: bool) -> MergedLinear:
    torch.manual_seed(0)
    m = MergedLinear(6, {"q_proj": 8, "k_proj": 4, "v_proj": 4}, bias=bias)
    with torch.no_grad():
        m.weight.copy_(torch.randn_like(m.weight))
        if bias:
            m.bias.copy_(torch.randn_like(m.bias))
    return m


def test_forward_is_the_unfused_projections_stacked():
    m = _merged(bias=True)
    x = torch.randn(5, 6)
    q, k, v = m(x).split(m.part_sizes, dim=-1)
    rows = m.part_rows()
    for part, out in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
        r = rows[part]
        torch.testing.assert_close(out, x @ m.weight[r].T + m.bias[r])


def test_shard_is_the_fusion_of_each_parts_slice():
    for bias in (False, True):
        full = _merged(bias)
        rows = full.part_rows()
        for rank in range(2):
            shard = _merged(bias)
            shard.shard_(rank, 2)
            assert shard.parts == {"q_proj": 4, "k_proj": 2, "v_proj": 2}
            assert shard.out_features == 8
            want = torch.cat([full.weight[r][rank * (r.stop - r.start) // 2:(rank + 1) * (r.stop - r.start) // 2]
                              for r in rows.values()])
            assert torch.equal(shard.weight, want)
            if bias:
                want_b = torch.cat([full.bias[r][rank * (r.stop - r.start) // 2:(rank + 1) * (r.stop - r.start) // 2]
                                    for r in rows.values()])
                assert torch.equal(shard.bias, want_b)


def test_checkpoint_tensors_are_views_under_checkpoint_names():
    model = nn.Module()
    model.self_attn = nn.Module()
    model.self_attn.qkv_proj = _merged(bias=True)
    model.self_attn.o_proj = nn.Linear(8, 6, bias=False)
    views = checkpoint_tensors(model)
    assert set(views) == {f"self_attn.{p}.{w}" for p in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")} \
        | {"self_attn.o_proj.weight"}
    fused = model.self_attn.qkv_proj.weight
    assert views["self_attn.k_proj.weight"].shape == (4, 6)
    with torch.no_grad():
        views["self_attn.k_proj.weight"].fill_(7.0)  # writes land in the fused parameter's rows
    assert (fused[8:12] == 7.0).all() and not (fused[:8] == 7.0).any() and not (fused[12:] == 7.0).any()


def test_llama_checkpoint_names_are_exactly_the_files(checkpoint):
    """Every tensor our fused model loads is named as in the file, and none is left out."""
    from specd.models.hf_config import LlamaArchConfig
    from specd.models.llama import LlamaForCausalLM

    for kind in ("llama", "qwen2", "qwen3"):
        path = checkpoint(kind)
        config = LlamaArchConfig.from_model_dir(path)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        ours = set(checkpoint_tensors(model))
        on_disk = set(tensor_names(path))
        if config.tie_word_embeddings:
            ours.discard("lm_head.weight")
        assert ours == on_disk - {n for n in on_disk if "rotary_emb" in n}, kind
