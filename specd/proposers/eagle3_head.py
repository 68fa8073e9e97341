"""The EAGLE-3 draft head (Li et al. 2025, arXiv:2503.01840) in SafeAILab's checkpoint layout.

One Llama decoder layer whose attention reads the concatenation of the normed token embedding and
the normed hidden state (so q/k/v take 2H inputs), a final norm and an LM head over a reduced draft
vocabulary. The first hidden state of a pair is `fc` of three target layers' inputs [3H_t -> H];
at later draft steps it is the head's own output (before `norm`), as EAGLE-3 was trained.

Tensors (no prefix): fc.weight [H, 3H_t]; midlayer.{hidden_norm, input_layernorm,
post_attention_layernorm}.weight [H]; midlayer.self_attn.{q,k,v}_proj.weight [*, 2H];
midlayer.self_attn.o_proj.weight; midlayer.mlp.{gate,up,down}_proj.weight; norm.weight;
lm_head.weight [draft_vocab, H]; d2t [draft_vocab] int64 (target id = draft id + d2t[draft id]);
t2d [vocab] bool; embed_tokens.weight [vocab, H] (often absent: borrowed from the target).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specd.proposers.pair_head import BatchKV


@dataclass(slots=True)
class Eagle3Config:
    """The fields of an EAGLE-3 config.json the head needs, validated on construction."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    norm_before_residual: bool = False  # a vLLM option: the residual is the normed hidden state
    aux_layer_ids: list[int] | None = None  # None: the target's layers (2, L // 2, L - 3)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # for RoPE parameters

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "draft_vocab_size", "target_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size: {self.draft_vocab_size} exceeds "
                             f"vocab_size={self.vocab_size}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Eagle3Config":
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        key = "eagle_aux_hidden_state_layer_ids"  # at the top level or under eagle_config
        aux = raw.get(key, (raw.get("eagle_config") or {}).get(key))
        return cls(
            hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            intermediate_size=raw["intermediate_size"], vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or hidden,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            aux_layer_ids=list(aux) if aux else None, raw=raw,
        )

    def rope_config(self) -> LlamaConfig:
        """A LlamaConfig carrying the head's RoPE (theta; llama3 or linear scaling)."""
        keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
        return LlamaConfig(hidden_size=self.hidden_size, head_dim=self.head_dim,
                           num_attention_heads=self.num_attention_heads,
                           **{k: self.raw[k] for k in keys if k in self.raw})


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in (at least) float32, then scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Eagle3Attention(nn.Module):
    """Grouped-query attention over 2H inputs, keys cached per sequence through BatchKV."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: BatchKV
                ) -> torch.Tensor:
        batch, seq, _ = x.shape  # x: [B, S, 2H]; cos, sin: [B, S, d]
        q = self.q_proj(x).view(batch, seq, self.num_heads, -1).transpose(1, 2)  # [B, nh, S, d]
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, -1).transpose(1, 2)  # [B, nkv, S, d]
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, -1).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = kv.attend(q, k, v, self.head_dim ** -0.5)  # [B, S, nh, d]; k, v stored
        return self.o_proj(out.reshape(batch, seq, -1))


class Eagle3Midlayer(nn.Module):
    """The decoder layer: attention over cat(input_layernorm(emb), hidden_norm(h)), then the MLP."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: BatchKV) -> torch.Tensor:
        normed = self.hidden_norm(hidden)  # [B, S, H]
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # [B, S, 2H], embeddings first
        hidden = residual + self.self_attn(x, cos, sin, kv)
        m = self.post_attention_layernorm(hidden)
        return hidden + self.mlp.down_proj(F.silu(self.mlp.gate_proj(m)) * self.mlp.up_proj(m))


class Eagle3Head(nn.Module):
    """fc + midlayer + norm + lm_head; logits come back in the target vocabulary."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Midlayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(cfg.rope_config())

    def project_target(self, rows: torch.Tensor) -> torch.Tensor:
        """Target aux rows [n, 3H_t] -> the head's first hidden state [n, H]."""
        width = 3 * self.cfg.target_hidden_size
        assert rows.shape[-1] == width, \
            f"EAGLE-3 needs [n, {width}] aux hidden states, got {tuple(rows.shape)}"
        return self.fc(rows)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: BatchKV
                ) -> torch.Tensor:
        """ids, positions [B, S]; hidden [B, S, H] -> the pre-norm output [B, S, H] (fed back)."""
        emb = self.embed_tokens(ids).to(hidden.dtype)
        cos, sin = self.rotary(hidden, positions)  # [B, S, head_dim] each
        return self.midlayer(emb, hidden, cos, sin, kv)

    def logits(self, hidden: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32; -inf at target ids outside the draft vocabulary.

        bitmask [N, W] int32 (target vocabulary, a grammar's allowed tokens) is translated to the
        draft vocabulary through d2t in one gather and masks the draft logits before the scatter.
        """
        draft = self.lm_head(self.norm(hidden)).float()  # [N, draft_vocab]
        if bitmask is not None:
            from specd.grammar.masking import translate_bitmask_to_draft_vocab

            allowed = translate_bitmask_to_draft_vocab(bitmask.to(draft.device), self.d2t)  # [N, Vd]
            draft = draft.masked_fill(~allowed, float("-inf"))
        target_ids = torch.arange(self.cfg.draft_vocab_size, device=draft.device) + self.d2t
        out = draft.new_full((draft.shape[0], self.cfg.vocab_size), float("-inf"))
        return out.index_copy_(1, target_ids, draft)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N] int64: the argmax of `logits`, taken in the draft vocabulary and mapped
        through d2t, without the [N, vocab] float32 scatter (target ids rise with draft ids, so a
        tie resolves to the same token)."""
        ids = self.lm_head(self.norm(hidden)).argmax(dim=-1)  # [N] draft ids
        return ids + self.d2t[ids]

    def masked_logits(self, hidden: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden, bitmask)
