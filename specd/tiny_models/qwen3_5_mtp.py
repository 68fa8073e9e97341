"""A tiny text-only Qwen3.5 target with its MTP head, in the published layout, random weights.

transformers' Qwen3_5ForCausalLM writes the main model (gated-delta-net linear attention layers
interleaved with full attention); the MTP head is added as `mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (a full-attention decoder layer) and `mtp.norm`, with
`mtp_num_hidden_layers: 1` in config.json, as Qwen3.5 checkpoints store them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

from specd.proposers.qwen3_5_mtp import mtp_layer_config
from specd.tiny_models.deepseek_mtp import add_tensors
from specd.tiny_models.llama import eos_ids


def tiny_qwen3_5_config(vocab_size: int, initializer_range: float = 0.1) -> Qwen3_5TextConfig:
    """4 layers (linear, full, linear, full); a large initializer_range peaks the distributions."""
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, full_attention_interval=2,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
        initializer_range=initializer_range, rms_norm_eps=1e-6, tie_word_embeddings=False,
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
        bos_token_id=0, eos_token_id=eos_ids(), pad_token_id=1,
    )


def mtp_tensors(model: Qwen3_5ForCausalLM, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """`mtp.*` tensors of a random MTP head for `model`."""
    cfg = model.config
    hidden = cfg.hidden_size
    layer = Qwen3_5DecoderLayer(mtp_layer_config(cfg), 0)
    layer.apply(model._init_weights)

    def zero_centred_norm(shape) -> torch.Tensor:  # weight 0 is the identity scale; perturb it
        return 0.1 * torch.randn(shape, generator=gen)

    state = {f"layers.0.{name}": zero_centred_norm(t.shape) if name.endswith("norm.weight") else t
             for name, t in layer.state_dict().items()}
    state["fc.weight"] = cfg.initializer_range * torch.randn(hidden, 2 * hidden, generator=gen)
    state["pre_fc_norm_embedding.weight"] = zero_centred_norm(hidden)
    state["pre_fc_norm_hidden.weight"] = zero_centred_norm(hidden)
    state["norm.weight"] = zero_centred_norm(hidden)
    return {f"mtp.{k}": v.detach().clone() for k, v in state.items()}


def write_tiny_qwen3_5_mtp_target(out_dir: str | Path, vocab_size: int, seed: int) -> Path:
    """Write config.json, generation_config.json and model.safetensors (main model + mtp.*)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(tiny_qwen3_5_config(vocab_size)).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    generation = GenerationConfig(bos_token_id=0, eos_token_id=eos_ids(), pad_token_id=1)
    generation.save_pretrained(str(out))
    with torch.no_grad():
        add_tensors(out, mtp_tensors(model, torch.Generator().manual_seed(seed + 1)))
    return out
