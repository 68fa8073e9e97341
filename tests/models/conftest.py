"""Tiny random Llama-family / DeepSeek-V3 / Qwen3.5 checkpoints for the runner tests.

Weights are re-drawn with a larger spread than transformers' init (std 0.02 gives near-constant
logits, which would make every comparison pass trivially).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2)


def _configs():
    import transformers as t

    return {
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(
            **COMMON, max_position_embeddings=512, bos_token_id=1, eos_token_id=[2, 3],
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32})),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**COMMON, tie_word_embeddings=True, eos_token_id=5)),
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**COMMON, head_dim=32, eos_token_id=5)),
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**COMMON, sliding_window=8)),
        "deepseek_v3": (t.DeepseekV3ForCausalLM, t.DeepseekV3Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
        "qwen3_5": (t.Qwen3_5ForCausalLM, t.Qwen3_5TextConfig(
            **COMMON, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
    }


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Matrices ~ N(0, 0.1), norm gains ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            if p.ndim >= 2:
                p.copy_(noise)
            elif "norm" in name and "bias" not in name:
                p.copy_(noise + (0.0 if name.endswith("A_log") else 1.0))
            else:
                p.copy_(noise)


def build_checkpoint(kind: str, out_dir: Path, seed: int = 0, **save_kwargs) -> Path:
    model_cls, config = _configs()[kind]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed)
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(kind, sharded=False) -> directory, built once per session."""
    made: dict[tuple[str, bool], Path] = {}

    def get(kind: str, sharded: bool = False) -> Path:
        key = (kind, sharded)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{kind}{'-sharded' if sharded else ''}")
            made[key] = build_checkpoint(kind, out, **({"max_shard_size": "40KB"} if sharded else {}))
        return made[key]

    return get


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(directory) -> the transformers model loaded from it in float32, cached."""
    from transformers import AutoModelForCausalLM

    loaded: dict[Path, torch.nn.Module] = {}

    def get(path: Path):
        if path not in loaded:
            loaded[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return loaded[path]

    return get
