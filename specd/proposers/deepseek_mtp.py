"""DeepSeek-V3 multi-token prediction (arXiv:2412.19437, sec. 2.2) as a proposer.

The MTP module sits in the target checkpoint as one extra layer, `model.layers.<L>.*` with
L = num_hidden_layers:
    h' = eh_proj(cat(enorm(embed(x_{p+1})), hnorm(h_p)))     [2H -> H]
    g  = DeepseekV3DecoderLayer(h')                          MLA; MoE or dense as the config says
    logits = shared_head.head(shared_head.norm(g))
h_p is the target's final hidden state, after its final norm (hidden_kind "final"). For k > 1 the
module is reused on its own g, the decoder output before shared_head.norm, as in the paper and
vLLM (SGLang feeds the normed state instead; CHAIN_AFTER_NORM switches).

The same module on a Llama target (config model_type "llama", as `specd train` writes for its
trained family) uses a Llama decoder layer. Its checkpoint may be a directory of its own holding
only `model.layers.<L>.*` with the target's config plus num_nextn_predict_layers; the shared
embeddings and LM head then come from the target checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from specd.models.weights import iter_tensors
from specd.proposers.pair_head import (BatchKV, PairHeadProposer, TransformersCache,
                                       load_module_tensors, read_first_tensor)

CHAIN_AFTER_NORM = False  # feed g (vLLM, the paper), not shared_head.norm(g) (SGLang)
_OWN_NAMES = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
              "shared_head.norm.weight", "shared_head.head.weight")


def decoder_parts(config: PretrainedConfig) -> tuple[type, type, type]:
    """(decoder layer, RMSNorm, rotary embedding) classes of the target's architecture."""
    if config.model_type == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        return m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm, m.DeepseekV3RotaryEmbedding
    if config.model_type == "llama":
        from transformers.models.llama import modeling_llama as m

        return m.LlamaDecoderLayer, m.LlamaRMSNorm, m.LlamaRotaryEmbedding
    raise ValueError(f"deepseek_mtp: no MTP layer for model_type {config.model_type!r} "
                     "(supported: deepseek_v3, llama)")


class DeepseekMTPHead(nn.Module):
    """One MTP module of DeepSeek-V3 around a transformers decoder layer of the target's kind."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        decoder_layer, rms_norm, rotary = decoder_parts(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.enorm = rms_norm(hidden, eps)
        self.hnorm = rms_norm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # layer_idx = L: MLA and the MoE-vs-dense choice (first_k_dense_replace) follow the config.
        self.layer = decoder_layer(config, layer_idx=config.num_hidden_layers)
        self.shared_head = nn.Module()
        self.shared_head.norm = rms_norm(hidden, eps)
        self.shared_head.head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.rotary = rotary(config)
        self.cache_kwarg = TransformersCache.kwarg_name(self.layer)

    def project_target(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's final hidden rows [n, H] are the head's input as they are."""
        assert rows.shape[-1] == self.eh_proj.out_features, \
            f"expected [n, H] hidden rows, got {tuple(rows.shape)}"
        return rows

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv: BatchKV) -> torch.Tensor:
        """ids, positions [B, S]; hidden [B, S, H] -> g [B, S, H] (the state fed back)."""
        emb = self.embed_tokens(ids).to(hidden.dtype)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))  # [B, S, H]
        out = self.layer(x, attention_mask=kv.mask, position_ids=positions,
                         position_embeddings=self.rotary(x, positions),
                         **{self.cache_kwarg: TransformersCache(kv)})
        return self.shared_head.norm(out) if CHAIN_AFTER_NORM else out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32."""
        normed = hidden if CHAIN_AFTER_NORM else self.shared_head.norm(hidden)
        return self.shared_head.head(normed).float()


def load_mtp_config(path: str | Path) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(str(path))
    config._attn_implementation = "sdpa"  # BatchKV hands the layer a boolean mask
    config._experts_implementation = "eager"
    return config


def load_deepseek_mtp_head(mtp_path: str | Path, target_path: str | Path | None = None
                           ) -> DeepseekMTPHead:
    """Build the head on CPU in float32 from `model.layers.<L>.*` of the MTP checkpoint (the
    target's own, or a directory of its own whose shared weights come from target_path)."""
    shared_paths = [mtp_path] + ([target_path] if target_path and target_path != mtp_path else [])
    config = load_mtp_config(mtp_path)
    quant = getattr(config, "quantization_config", None)
    if quant:
        raise ValueError(f"{mtp_path}: quantized checkpoints ({quant.get('quant_method')}) are "
                         "not supported by the MTP drafter; use a bf16 checkpoint")
    if not getattr(config, "num_nextn_predict_layers", 0):
        raise ValueError(f"{mtp_path}: num_nextn_predict_layers is 0: no MTP layer")
    prefix = f"model.layers.{config.num_hidden_layers}."
    tensors = {name[len(prefix):]: t for name, t in iter_tensors(mtp_path, prefix)}
    if not tensors:
        raise KeyError(f"{mtp_path}: no MTP tensors under {prefix}*")
    # DeepSeek-V3 stores copies of the shared embeddings in the MTP layer; else use the originals.
    if "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = _shared_tensor(shared_paths, ("model.embed_tokens.weight",))
    if "shared_head.head.weight" not in tensors:
        # A target with tied embeddings stores only the embedding matrix.
        names = ("lm_head.weight",) + (("model.embed_tokens.weight",)
                                       if getattr(config, "tie_word_embeddings", False) else ())
        tensors["shared_head.head.weight"] = _shared_tensor(shared_paths, names)
    missing = [prefix + n for n in _OWN_NAMES if n not in tensors]
    if missing:
        raise KeyError(f"{mtp_path}: MTP layer lacks {missing}")
    head = DeepseekMTPHead(config)
    for name in _OWN_NAMES:
        head.get_parameter(name).data.copy_(tensors.pop(name))
    load_module_tensors(head.layer, tensors, f"{mtp_path}: {prefix}*")
    return head


def _shared_tensor(paths: list, names: tuple[str, ...]) -> torch.Tensor:
    """The first of `names` in the first checkpoint of `paths` holding any of them."""
    errors = []
    for path in paths:
        try:
            return read_first_tensor(path, names)
        except KeyError as e:
            errors.append(str(e))
    raise KeyError("; ".join(errors))


class DeepseekMTPProposer(PairHeadProposer):
    """Drafts with DeepSeek-V3's MTP module, read from the target checkpoint itself (or from an
    MTP directory of its own, sharing the target's embeddings and LM head)."""

    method = "deepseek_mtp"
    hidden_kind = "final"

    def __init__(self, mtp_path: str | Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, target_path: str | Path | None = None,
                 **head_options) -> None:
        head = load_deepseek_mtp_head(mtp_path, target_path)
        self.vocab_size = head.shared_head.head.out_features
        router = getattr(head.layer.mlp, "gate", None)  # MoE layers only
        router_state = None if router is None else {
            k: v.clone() for k, v in router.state_dict().items()}
        head = head.to(device=device, dtype=dtype)
        if router is not None:  # the router stays float32, as transformers keeps it
            router.float().load_state_dict(router_state)
        super().__init__(head, device, dtype, **head_options)
