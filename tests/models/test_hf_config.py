"""Parsing Llama-family config.json files, both rope layouts, and the validation errors."""

from __future__ import annotations

import pytest

from specd.models.hf_config import LlamaArchConfig, UnsupportedArchitectureError, normalize_rope

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def parse(arch: str, **fields) -> LlamaArchConfig:
    return LlamaArchConfig.from_dict({"architectures": [arch], **BASE, **fields})


def test_checkpoints_written_by_transformers(checkpoint):
    llama = LlamaArchConfig.from_model_dir(checkpoint("llama"))
    assert llama.rope_theta == 500000.0 and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.rope_scaling["original_max_position_embeddings"] == 32
    assert llama.eos_token_ids == [2, 3] and llama.bos_token_id == 1 and llama.head_dim == 16
    qwen2 = LlamaArchConfig.from_model_dir(checkpoint("qwen2"))
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.tie_word_embeddings
    assert qwen2.sliding_window is None and qwen2.layer_types == ["full_attention"] * 4
    qwen3 = LlamaArchConfig.from_model_dir(checkpoint("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    mistral = LlamaArchConfig.from_model_dir(checkpoint("mistral"))
    assert mistral.sliding_window == 8 and mistral.layer_sliding_window(3) == 8


def test_legacy_rope_fields():
    cfg = parse("LlamaForCausalLM", rope_theta=500000.0,
                rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert normalize_rope({"rope_theta": 1e6}) == (1e6, None)
    assert normalize_rope({}) == (10000.0, None)
    assert normalize_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 3.0}}) == (3.0, None)


def test_qwen_sliding_window_layout():
    cfg = parse("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    assert cfg.layer_sliding_window(0) is None and cfg.layer_sliding_window(1) == 16
    assert parse("Qwen2ForCausalLM", use_sliding_window=False, sliding_window=16).sliding_window is None
    assert parse("LlamaForCausalLM", sliding_window=16).sliding_window is None


def test_generation_config_adds_eos():
    cfg = LlamaArchConfig.from_dict({"architectures": ["LlamaForCausalLM"], **BASE, "eos_token_id": 2},
                                    {"eos_token_id": [2, 7]})
    assert cfg.eos_token_ids == [2, 7]


@pytest.mark.parametrize("fields,match", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_scaling"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0}), "low_freq_factor"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(vocab_size=0), "vocab_size"),
])
def test_invalid_configs_name_the_field(fields, match):
    with pytest.raises(UnsupportedArchitectureError, match=match):
        parse("LlamaForCausalLM", **fields)


def test_unknown_architecture():
    with pytest.raises(UnsupportedArchitectureError, match="architectures"):
        parse("DeepseekV3ForCausalLM")
