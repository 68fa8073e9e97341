"""A tiny DeepSeek-V3 target with its MTP layer, in the published layout, random weights.

transformers' DeepseekV3ForCausalLM writes the main model (MLA attention, a dense first layer and
MoE after it); the MTP module is added as `model.layers.<L>.*` (L = num_hidden_layers) with
per-expert weights, `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm, head}` and `embed_tokens`,
as DeepSeek-V3's checkpoint stores it. Like that checkpoint, the MTP layer's embed_tokens and
shared_head.head are copies of the main model's embeddings and LM head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from specd.tiny_models.llama import eos_ids

NUM_LAYERS = 2  # layer 0 dense, layer 1 MoE; the MTP layer (index 2) is MoE too


def tiny_deepseek_config(vocab_size: int, initializer_range: float = 0.1) -> DeepseekV3Config:
    """Tiny MLA + MoE shapes; initializer_range is large so next-token distributions are peaked."""
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, num_nextn_predict_layers=1, max_position_embeddings=4096,
        initializer_range=initializer_range, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=eos_ids(), pad_token_id=1,
    )


def mtp_layer_tensors(model: DeepseekV3ForCausalLM, gen: torch.Generator
                      ) -> dict[str, torch.Tensor]:
    """`model.layers.<L>.*` tensors of a random MTP module for `model`."""
    cfg = model.config
    num_layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=num_layers)
    layer.apply(model._init_weights)
    state = {}
    for name, t in layer.state_dict().items():
        if name.endswith("norm.weight"):  # not all ones, so a misplaced norm changes the output
            t = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            t = 0.1 * torch.randn(t.shape, generator=gen)
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> per-expert gate, up [I, H]
            base = name[: -len("gate_up_proj")]
            for e, expert in enumerate(t.unbind(0)):
                gate, up = expert.chunk(2, dim=0)
                state[f"{base}{e}.gate_proj.weight"], state[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):  # [E, H, I] -> per-expert [H, I]
            base = name[: -len("down_proj")]
            for e, down in enumerate(t.unbind(0)):
                state[f"{base}{e}.down_proj.weight"] = down
        else:
            state[name] = t
    std = cfg.initializer_range
    state["enorm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    state["hnorm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    state["eh_proj.weight"] = std * torch.randn(hidden, 2 * hidden, generator=gen)
    state["shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    state["shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    state["embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    prefix = f"model.layers.{num_layers}."
    return {prefix + k: v.detach().clone() for k, v in state.items()}  # no shared storage


def add_tensors(model_dir: Path, extra: dict[str, torch.Tensor]) -> None:
    """Add tensors to a saved checkpoint: rewrite the (last) shard and keep the index consistent."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text(encoding="utf-8"))
        shard = sorted(set(index["weight_map"].values()))[-1]
        index["weight_map"].update({name: shard for name in extra})
        index_path.write_text(json.dumps(index, indent=2), encoding="utf-8")
    else:
        shard = "model.safetensors"
    path = model_dir / shard
    tensors = load_file(str(path))
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_tiny_deepseek_mtp_target(out_dir: str | Path, vocab_size: int, seed: int) -> Path:
    """Write config.json, generation_config.json and model.safetensors (main model + MTP layer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tiny_deepseek_config(vocab_size)).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    generation = GenerationConfig(bos_token_id=0, eos_token_id=eos_ids(), pad_token_id=1)
    generation.save_pretrained(str(out))
    with torch.no_grad():
        add_tensors(out, mtp_layer_tensors(model, torch.Generator().manual_seed(seed + 1)))
    return out
