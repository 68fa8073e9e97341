"""Train a DeepSeek-style MTP module for a frozen Llama target and write it as its own directory.

Layout: the target's config.json plus `num_nextn_predict_layers: 1`, and `model.layers.<L>.*`
(enorm, hnorm, eh_proj, a Llama decoder layer, shared_head.norm), as DeepSeek-V3 stores its MTP
layer; the embeddings and LM head are the target's (frozen, not written, read from the target at
load time). specd serves it with `--speculative-algorithm deepseek_mtp --speculative-draft-model DIR`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from specd.proposers.deepseek_mtp import DeepseekMTPHead
from specd.train.pair_head import PairHeadTask

SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_config(target: LlamaForCausalLM) -> LlamaConfig:
    raw = target.config.to_dict()
    raw.update(num_nextn_predict_layers=1, architectures=["LlamaForCausalLMMTP"])
    config = LlamaConfig.from_dict(raw)
    config._attn_implementation = "sdpa"
    return config


def build_mtp_task(target: LlamaForCausalLM, num_steps: int) -> tuple[PairHeadTask, LlamaConfig]:
    config = mtp_config(target)
    head = DeepseekMTPHead(config)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.shared_head.head.weight.copy_(target.get_output_embeddings().weight)
    for name in SHARED:
        head.get_parameter(name).requires_grad_(False)
    task = PairHeadTask(head=head, first_hidden=lambda f: f.final, logits=head.logits,
                        label_probs=lambda f: torch.softmax(f.logits, dim=-1), num_steps=num_steps)
    return task, config


def save_mtp(head: DeepseekMTPHead, config: LlamaConfig, out_dir: str | Path, tokenizer,
             dtype: torch.dtype = torch.bfloat16) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = f"model.layers.{config.num_hidden_layers}."
    tensors = {}
    for name, t in head.state_dict().items():
        if name in SHARED or name.startswith("rotary."):
            continue
        key = name.removeprefix("layer.")  # the decoder layer's own names sit under the prefix
        tensors[prefix + key] = t.detach().to("cpu", dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = config.to_dict()
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    raw.pop("_attn_implementation_autoset", None)
    (out / "config.json").write_text(json.dumps(raw, indent=2), encoding="utf-8")
    tokenizer.save_pretrained(str(out))
    return out
