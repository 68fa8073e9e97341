"""A compact Llama-family decoder over flattened variable-length batches (gpt-fast style).

Covers Llama 2/3.x, Qwen2, Qwen3 and Mistral (see hf_config.py). Module and parameter names are
exactly transformers' (`model.layers.N.self_attn.q_proj.weight`, ...), so a checkpoint's tensors
load by name. A forward takes the tokens of many sequences concatenated, `[num_tokens]`, with
their positions; attention reads and writes the paged KV cache through `AttentionMetadata`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specd.models.attention import AttentionMetadata, paged_attention, write_kv
from specd.models.hf_config import LlamaArchConfig
from specd.models.kv_cache import PagedKVCache
from specd.models.static_attention import StaticAttentionMetadata, static_paged_attention
from specd.models.weights import iter_tensors


def row_parallel(linear: nn.Linear, x: torch.Tensor, group) -> torch.Tensor:
    """linear(x), where under tensor parallelism each rank holds a slice of the input features.

    The partial products are summed over the group and the bias (replicated) is added once,
    after the sum. group None: the plain, unsharded linear.
    """
    if group is None:
        return linear(x)
    out = F.linear(x, linear.weight)
    torch.distributed.all_reduce(out, group=group)
    return out if linear.bias is None else out + linear.bias


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: LlamaArchConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with llama3 / linear scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed from the positions of the batch, not from a precomputed cache."""

    def __init__(self, config: LlamaArchConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def reset_inv_freq(self) -> None:
        """Recompute the buffer (after the model was materialized from the meta device)."""
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, D] (the rotate-half convention of HF checkpoints)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaArchConfig, layer_id: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        self.scale = d ** -0.5
        self.sliding_window = config.layer_sliding_window(layer_id)
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_proj_bias, dtype=dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.tp_group = None  # set by tensor_parallel.shard_llama_: o_proj is then row-parallel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(cache_k, cache_v, k, v, meta.slot_mapping)
        # The fixed (CUDA-graph) layout or the varlen one; both take and return [T, Hq, D].
        attend = static_paged_attention if isinstance(meta, StaticAttentionMetadata) else paged_attention
        out = attend(q, cache_k, cache_v, meta, self.scale, self.sliding_window)
        return row_parallel(self.o_proj, out.reshape(t, self.num_heads * self.head_dim), self.tp_group)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaArchConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=bias, dtype=dtype)

        self.tp_group = None  # set by tensor_parallel.shard_llama_: down_proj is then row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel(self.down_proj, F.silu(self.gate_proj(x)) * self.up_proj(x), self.tp_group)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaArchConfig, layer_id: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, meta, cache_k, cache_v):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, cache_k, cache_v)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaArchConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """Decoder + output projection; `forward` returns hidden states, `compute_logits` the logits."""

    def __init__(self, config: LlamaArchConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: PagedKVCache, aux_layer_ids: tuple[int, ...] | list[int] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions: [T]. Returns (hidden [T, H] after the final norm,
        aux [T, len(aux_layer_ids) * H] or None).

        aux concatenates, in the order given, the residual stream *entering* each chosen layer
        (transformers' `hidden_states[i]`), the features EAGLE-3 drafters are trained on.
        """
        assert input_ids.ndim == 1 and positions.shape == input_ids.shape, (input_ids.shape, positions.shape)
        x = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        wanted = set(aux_layer_ids)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in wanted:
                captured[i] = x
            x = layer(x, cos, sin, meta, kv_cache.k_caches[i], kv_cache.v_caches[i])
        aux = torch.cat([captured[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return self.model.norm(x), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, vocab] float32; call it on the rows whose logits are needed only."""
        return self.lm_head(hidden).float()


def load_llama(model_dir: str | Path, config: LlamaArchConfig, dtype: torch.dtype,
               device: torch.device) -> LlamaForCausalLM:
    """Build the model without random init (meta device) and fill it from the safetensors."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.model.rotary_emb.reset_inv_freq()
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in iter_tensors(model_dir):
        param = params.get(name)
        if param is None:
            continue  # e.g. rotary inv_freq of old checkpoints, MTP heads: not ours
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} "
                             f"!= model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    missing = set(params) - loaded
    if config.tie_word_embeddings:
        # One copy of the tied matrix is enough (checkpoints usually store only the embedding).
        loaded_embed = "model.embed_tokens.weight" in loaded
        missing.discard("lm_head.weight" if loaded_embed else "model.embed_tokens.weight")
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors: {sorted(missing)[:8]}"
                         + (" ..." if len(missing) > 8 else ""))
    return model.eval()
