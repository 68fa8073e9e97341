"""A synthetic target checkpoint for the end-to-end bench: real shapes, decisive random weights.

Random weights drawn the usual way give near-tied logits, and a bf16 target's greedy continuation
then flips with batch composition and with q (decode vs verify kernels): the replay drafter's
references would stop matching. This checkpoint keeps every shape (so every matmul costs what the
real model's does) but makes the next token obvious: the residual stream stays dominated by the
token's embedding (o_proj and down_proj are small), and lm_head row perm(u) is embedding row u,
so the target maps token u to perm(u) with a logit margin of ~|E_u|^2 against noise of ~|E_u|.
Only the first `num_live_tokens` ids are ever produced (the other lm_head rows are zero), so the
tiny tokenizer written next to it can decode everything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_synthetic_llama(out_dir: str | Path, shape: dict, *, device: str = "cuda", seed: int = 0,
                          num_live_tokens: int = 512, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json, one safetensors shard per layer (+ index) and the tiny tokenizer."""
    from safetensors.torch import save_file

    from specd.tiny_models.llama import eos_ids
    from specd.tiny_models.tokenizer import train_tokenizer, write_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    layers = shape["num_hidden_layers"]
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*size, std):
        return (torch.randn(*size, generator=gen, device=device) * std).to(dtype)

    embed = torch.randn(vocab, h, generator=gen, device=device)  # float32 while deriving lm_head
    perm = torch.randperm(num_live_tokens, generator=gen, device=device)
    lm_head = torch.zeros(vocab, h, device=device)
    lm_head[perm] = embed[:num_live_tokens]  # row perm(u) = E_u: token u is followed by perm(u)
    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / name))
        weight_map.update({k: name for k in tensors})

    shard("embed.safetensors", {"model.embed_tokens.weight": embed.to(dtype),
                                "lm_head.weight": (lm_head / h ** 0.5).to(dtype),
                                "model.norm.weight": torch.ones(h, dtype=dtype, device=device)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard(f"layer{i:03d}.safetensors", {
            p + "self_attn.q_proj.weight": normal(heads * d, h, std=0.02),
            p + "self_attn.k_proj.weight": normal(kv * d, h, std=0.02),
            p + "self_attn.v_proj.weight": normal(kv * d, h, std=0.02),
            p + "self_attn.o_proj.weight": normal(h, heads * d, std=0.0005),
            p + "mlp.gate_proj.weight": normal(inter, h, std=0.02),
            p + "mlp.up_proj.weight": normal(inter, h, std=0.02),
            p + "mlp.down_proj.weight": normal(h, inter, std=0.0005),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype, device=device),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype, device=device),
        })
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "vocab_size": vocab, "hidden_size": h, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": d, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "max_position_embeddings": 8192, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16" if dtype == torch.bfloat16 else "float32",
              "bos_token_id": 0, "eos_token_id": eos_ids(), "pad_token_id": 1}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out, train_tokenizer(num_live_tokens))
    return out
