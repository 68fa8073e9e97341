"""Train an EAGLE-3 head for a frozen target and write it in SafeAILab's layout.

The head is specd's own inference module (specd.proposers.eagle3_head.Eagle3Head); its reduced
draft vocabulary is the most frequent target tokens of the training stream (special tokens always
in), mapped by `d2t` / `t2d` as EAGLE-3 publishes them. The embeddings are the target's, frozen,
and not written (the loader borrows them, as for published heads).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from specd.proposers.eagle3_head import Eagle3Config, Eagle3Head
from specd.train.pair_head import PairHeadTask

NUM_SPECIAL_TOKENS = 4


def frequent_token_ids(stream: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """Sorted target ids of the draft vocabulary: special tokens, then the most frequent ids."""
    counts = torch.bincount(stream.long(), minlength=vocab_size).float()
    counts[:NUM_SPECIAL_TOKENS] = float("inf")
    return counts.topk(draft_vocab_size).indices.sort().values


def eagle3_config_dict(target: dict, draft_vocab_size: int, aux_layer_ids: list[int] | None,
                       dtype: str) -> dict:
    """config.json of an EAGLE-3 head shaped after the target's config (SafeAILab's keys)."""
    hidden, heads = target["hidden_size"], target["num_attention_heads"]
    rope = target.get("rope_parameters") or {}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": target["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads") or heads,
        "head_dim": target.get("head_dim") or hidden // heads,
        "num_hidden_layers": 1,
        "max_position_embeddings": target.get("max_position_embeddings", 2048),
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", target.get("rope_theta", 10000.0)),
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": hidden,
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "pad_token_id": target.get("pad_token_id"),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    return config


def build_eagle3_task(target: LlamaForCausalLM, draft_ids: torch.Tensor, aux_layer_ids: list[int],
                      num_steps: int) -> tuple[PairHeadTask, dict]:
    target_cfg = target.config.to_dict()
    raw = eagle3_config_dict(target_cfg, len(draft_ids), aux_layer_ids, "bfloat16")
    head = Eagle3Head(Eagle3Config.from_dict(raw))
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    head.embed_tokens.weight.requires_grad_(False)
    draft_on = draft_ids.to(next(target.parameters()).device)
    task = PairHeadTask(
        head=head,
        first_hidden=lambda f: head.fc(f.aux),
        logits=lambda out: head.lm_head(head.norm(out)),
        label_probs=lambda f: torch.softmax(f.logits[..., draft_on], dim=-1),
        num_steps=num_steps)
    return task, raw


def save_eagle3(head: Eagle3Head, raw_config: dict, out_dir: str | Path, tokenizer,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in head.state_dict().items():
        if name == "embed_tokens.weight":
            continue  # borrowed from the target at load time
        tensors[name] = t.detach().cpu().contiguous() if name in ("d2t", "t2d") else \
            t.detach().to("cpu", dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = dict(raw_config, torch_dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(raw, indent=2), encoding="utf-8")
    tokenizer.save_pretrained(str(out))
    return out
