"""A tiny EAGLE-3 head for a tiny Llama target, in SafeAILab's published layout, random weights.

The head has a reduced draft vocabulary (d2t / t2d maps) and no `embed_tokens.weight`, so loading
it exercises both the vocabulary mapping and the borrowing of the target's embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

NUM_SPECIAL_TOKENS = 4  # ids 0..3 (bos, eos, im_start, im_end) always stay in the draft vocab


def draft_vocab_ids(vocab_size: int, draft_vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted target ids of the draft vocabulary: the special tokens plus a seeded random subset."""
    if not NUM_SPECIAL_TOKENS <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size: must be in [{NUM_SPECIAL_TOKENS}, {vocab_size}], "
                         f"got {draft_vocab_size}")
    num_special = NUM_SPECIAL_TOKENS
    rest = torch.randperm(vocab_size - num_special, generator=gen)[:draft_vocab_size - num_special]
    ids = torch.cat([torch.arange(num_special), rest + num_special])
    return ids.sort().values


def write_tiny_eagle3(out_dir: str | Path, target_dir: str | Path, seed: int,
                      draft_vocab_size: int | None = None, init_std: float = 0.1) -> Path:
    """Write config.json + model.safetensors of an EAGLE-3 head shaped after the target's config.

    init_std is larger than Llama's 0.02, so the draft distribution is peaked (as tiny_models.llama
    does for the target).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(Path(target_dir) / "config.json", encoding="utf-8") as f:
        target = json.load(f)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads = target["num_attention_heads"]
    kv_heads = target.get("num_key_value_heads") or heads
    head_dim = target.get("head_dim") or hidden // heads
    inter = target["intermediate_size"]
    draft_vocab = draft_vocab_size or vocab // 2
    rope = target.get("rope_parameters") or {}
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * init_std

    def norm_weight() -> torch.Tensor:  # not all ones, so swapped norms change the output
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    ids = draft_vocab_ids(vocab, draft_vocab, gen)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": normal(hidden, 3 * hidden),
        "midlayer.hidden_norm.weight": norm_weight(),
        "midlayer.input_layernorm.weight": norm_weight(),
        "midlayer.self_attn.q_proj.weight": normal(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": normal(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": norm_weight(),
        "midlayer.mlp.gate_proj.weight": normal(inter, hidden),
        "midlayer.mlp.up_proj.weight": normal(inter, hidden),
        "midlayer.mlp.down_proj.weight": normal(hidden, inter),
        "norm.weight": norm_weight(),
        "lm_head.weight": normal(draft_vocab, hidden),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "max_position_embeddings": target.get("max_position_embeddings", 2048),
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", target.get("rope_theta", 10000.0)),
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "pad_token_id": target.get("pad_token_id"),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return out
