"""Train the target: a small Llama on the standard library's sources, in the HF layout.

The model and its loss are transformers' own LlamaForCausalLM, so the checkpoint is exactly what
`save_pretrained` writes and every HF-compatible tool reads it; specd serves it with its own runner.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specd.train.corpus import WindowSampler
from specd.train.loop import LoopConfig, LoopResult, run_loop
from specd.train.shapes import LlamaShape


def llama_config(shape: LlamaShape, bos_id: int, eos_ids: list[int], pad_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=pad_id,
        attn_implementation="sdpa",
    )


def autocast(device: torch.device):
    """bfloat16 autocast on CUDA; float32 on CPU, where bf16 matmuls are slow."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def train_lm(model: LlamaForCausalLM, sampler: WindowSampler, cfg: LoopConfig,
             device: torch.device, name: str = "target", log=print) -> LoopResult:
    """Next-token cross-entropy on random windows of the token stream."""
    model.train()

    def loss_fn(step: int) -> torch.Tensor:
        ids = sampler.next(device)
        with autocast(device):
            return model(input_ids=ids, labels=ids).loss

    return run_loop(model.parameters(), loss_fn, cfg, name, log)


def save_llama(model: LlamaForCausalLM, out_dir: str | Path, tokenizer, dtype=torch.bfloat16) -> Path:
    """config.json, generation_config.json, model.safetensors (in `dtype`) and the tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype).eval()
    model.config.torch_dtype = str(dtype).removeprefix("torch.")
    model.save_pretrained(str(out), safe_serialization=True)
    cfg = model.config
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.pad_token_id).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


@torch.no_grad()
def mean_nll(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int, device: torch.device,
             max_windows: int = 64) -> float:
    """Mean next-token loss over consecutive windows of a (held-out) stream."""
    model.eval()
    n = min(max_windows, stream.numel() // (seq_len + 1))
    if n < 1:
        raise ValueError("held-out stream is shorter than one window")
    ids = stream[: n * seq_len].view(n, seq_len).long().to(device)
    losses = []
    for chunk in ids.split(16):
        with autocast(device):
            losses.append(model(input_ids=chunk, labels=chunk).loss.float())
    return float(torch.stack(losses).mean())
