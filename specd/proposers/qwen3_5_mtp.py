"""Qwen3.5 / Qwen3-Next multi-token prediction as a proposer (hidden_kind "final").

The head is stored in the target checkpoint under `mtp.*`:
    x = mtp.fc(cat(pre_fc_norm_embedding(embed(x_{p+1})), pre_fc_norm_hidden(h_p)))   [2H -> H]
    g = mtp.norm(mtp.layers.0(x))        one full-attention decoder layer of the target's family
    logits = lm_head(g)
The norms are zero-centred (x * (1 + w)). Embeddings and the LM head are the target's. As in vLLM
(qwen3_5_mtp.py), g is the normed output, and it is what is fed back as h_p at later draft steps:
the same kind of state as the target's final hidden state, which is also taken after a norm.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedConfig

from specd.models.weights import iter_tensors
from specd.proposers.pair_head import (BatchKV, PairHeadProposer, TransformersCache,
                                       load_module_tensors, read_first_tensor)

MTP_PREFIX = "mtp."
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
_OWN_NAMES = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
              "norm.weight")


def _layer_classes(model_type: str) -> tuple[type, type, type]:
    """(decoder layer, RMSNorm, rotary embedding) classes of the target's text model family."""
    if model_type == "qwen3_5_text":
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        return m.Qwen3_5DecoderLayer, m.Qwen3_5RMSNorm, m.Qwen3_5TextRotaryEmbedding
    if model_type == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

        return m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm, m.Qwen3_5MoeTextRotaryEmbedding
    if model_type == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        return m.Qwen3NextDecoderLayer, m.Qwen3NextRMSNorm, m.Qwen3NextRotaryEmbedding
    raise ValueError(f"model_type: {model_type!r} has no Qwen MTP head "
                     "(expected qwen3_5_text, qwen3_5_moe_text or qwen3_next)")


def mtp_layer_config(text_config: PreTrainedConfig) -> PreTrainedConfig:
    """The target's text config reshaped for the single full-attention MTP layer (index 0)."""
    cfg = copy.deepcopy(text_config)
    cfg.layer_types = ["full_attention"]
    cfg.num_hidden_layers = 1
    cfg._attn_implementation = "sdpa"  # BatchKV hands the layer a boolean mask
    cfg._experts_implementation = "eager"
    return cfg


class Qwen35MTPHead(nn.Module):
    """fc over the normed (embedding, hidden) pair, a decoder layer, the final norm, the LM head."""

    def __init__(self, text_config: PreTrainedConfig) -> None:
        super().__init__()
        layer_cls, norm_cls, rotary_cls = _layer_classes(text_config.model_type)
        cfg = mtp_layer_config(text_config)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, hidden)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer_cls(cfg, 0)
        self.norm = norm_cls(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, cfg.vocab_size, bias=False)
        self.rotary = rotary_cls(cfg)
        self.cache_kwarg = TransformersCache.kwarg_name(self.layer)

    def project_target(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's final hidden rows [n, H] are the head's input as they are."""
        assert rows.shape[-1] == self.fc.out_features, \
            f"expected [n, H] hidden rows, got {tuple(rows.shape)}"
        return rows

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: BatchKV
                ) -> torch.Tensor:
        """ids, positions [B, S]; hidden [B, S, H] -> g [B, S, H], after mtp.norm."""
        emb = self.embed_tokens(ids).to(hidden.dtype)
        pair = [self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)]  # embedding first
        x = self.fc(torch.cat(pair, dim=-1))  # [B, S, H]
        # Qwen3.5's rotary is multimodal (M-RoPE): text tokens use one position on all 3 axes.
        rope_pos = positions[None].expand(3, -1, -1) if hasattr(self.rotary, "mrope_section") \
            else positions  # [3, B, S] or [B, S]
        out = self.layer(x, position_embeddings=self.rotary(x, rope_pos), attention_mask=kv.mask,
                         position_ids=positions, **{self.cache_kwarg: TransformersCache(kv)})
        if isinstance(out, tuple):  # MoE layers of some versions also return router logits
            out = out[0]
        return self.norm(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()


def load_qwen3_5_mtp_head(target_path: str | Path) -> Qwen35MTPHead:
    """Build the head on CPU in float32 from `mtp.*` plus the target's embeddings and LM head."""
    text = AutoConfig.from_pretrained(str(target_path)).get_text_config()
    if not getattr(text, "mtp_num_hidden_layers", 1):
        raise ValueError(f"{target_path}: mtp_num_hidden_layers is 0: no MTP head")
    tensors = {name[len(MTP_PREFIX):]: t for name, t in iter_tensors(target_path, MTP_PREFIX)}
    if not tensors:
        raise KeyError(f"{target_path}: no MTP tensors under {MTP_PREFIX}*")
    # mtp_use_dedicated_embeddings checkpoints carry their own; the others share the target's.
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is None:
        embed = read_first_tensor(target_path, EMBED_NAMES)
    head = Qwen35MTPHead(text)
    layer_prefix = "layers.0."
    layer = {n[len(layer_prefix):]: t for n, t in tensors.items() if n.startswith(layer_prefix)}
    load_module_tensors(head.layer, layer, f"{target_path}: {MTP_PREFIX}{layer_prefix}*")
    missing = [MTP_PREFIX + n for n in _OWN_NAMES if n not in tensors]
    unexpected = [MTP_PREFIX + n for n in tensors
                  if n not in _OWN_NAMES and not n.startswith(layer_prefix)]
    if missing or unexpected:  # mtp_num_hidden_layers > 1 would show up here
        raise KeyError(f"{target_path}: MTP head: missing {missing}, unexpected {unexpected}")
    for name in _OWN_NAMES:
        head.get_parameter(name).data.copy_(tensors[name])
    head.embed_tokens.weight.data.copy_(embed)
    try:
        lm_head = read_first_tensor(target_path, ("lm_head.weight",))
    except KeyError:  # tied word embeddings
        lm_head = read_first_tensor(target_path, EMBED_NAMES)
    head.lm_head.weight.data.copy_(lm_head)
    return head


class Qwen35MTPProposer(PairHeadProposer):
    """Drafts with the Qwen3.5 MTP head, read from the target checkpoint itself."""

    method = "qwen3_5_mtp"
    hidden_kind = "final"

    def __init__(self, target_path: str | Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, **head_options) -> None:
        head = load_qwen3_5_mtp_head(target_path)
        self.vocab_size = head.lm_head.out_features
        super().__init__(head.to(device=device, dtype=dtype), device, dtype, **head_options)
