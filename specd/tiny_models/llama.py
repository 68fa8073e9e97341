"""Tiny Llama-architecture checkpoints (random weights) in the standard Hugging Face layout."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specd.tiny_models.tokenizer import SPECIAL_TOKENS, EOS_TOKEN, IM_END


def eos_ids() -> list[int]:
    return [SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(IM_END)]


def write_tiny_llama(out_dir: str | Path, *, vocab_size: int, hidden_size: int, num_layers: int,
                     num_heads: int, num_kv_heads: int, intermediate_size: int, seed: int,
                     initializer_range: float = 0.1) -> Path:
    """Write a randomly initialised LlamaForCausalLM.

    initializer_range is larger than Llama's 0.02 so the next-token distribution is peaked: with
    near-uniform logits, greedy comparisons would hinge on float rounding between near-ties.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=initializer_range,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=eos_ids(), pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=0, eos_token_id=eos_ids(), pad_token_id=1).save_pretrained(str(out))
    return out
