"""A compact Llama-family decoder over flattened variable-length batches (gpt-fast style).

Covers Llama 2/3.x, Qwen2, Qwen3 and Mistral (see hf_config.py). Module names follow
transformers', except that q/k/v are one fused `qkv_proj` and gate/up one `gate_up_proj`
(merged_linear.py): fewer, larger GEMMs. Checkpoints keep transformers' names on disk
(`model.layers.N.self_attn.q_proj.weight`, ...); loading maps each onto its rows of the fused
weight. A forward takes the tokens of many sequences concatenated, `[num_tokens]`, with their
positions; attention reads and writes the paged KV cache through `AttentionMetadata`.

A decoder layer is three pieces: `attention_input` (input RMSNorm, the fused QKV GEMM, q/k norms,
RoPE), the attention itself (KV-cache write + paged attention, `LlamaAttention.attend`) and
`attention_output_and_mlp` (o_proj, residual, post-attention RMSNorm, the fused gate/up GEMM,
SwiGLU, down_proj, residual).
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
from specd.models.linear import Linear, linear
from specd.models.merged_linear import MergedLinear, checkpoint_tensors
from specd.models.static_attention import StaticAttentionMetadata, static_paged_attention
from specd.models.weights import iter_tensors


def row_parallel(layer: nn.Linear, x: torch.Tensor, group) -> torch.Tensor:
    """layer(x), where under tensor parallelism each rank holds a slice of the input features.

    The partial products are summed over the group and the bias (replicated) is added once,
    after the sum. group None: the plain, unsharded linear.
    """
    if group is None:
        return layer(x)
    out = linear(x, layer.weight)
    torch.distributed.all_reduce(out, group=group)
    return out if layer.bias is None else out + layer.bias


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is x * rsqrt(mean(x^2) + eps), one fused kernel where torch has one (and a
        # single node for inductor) instead of pow / mean / add / rsqrt / mul.
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
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
    """cos/sin tables of the batch's positions: computed from them, or gathered from a table of
    every position once the runner has reserved one (`reserve`)."""

    def __init__(self, config: LlamaArchConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._table: torch.Tensor | None = None  # [P, 2D]: cos | signed sin of positions 0..P-1

    def reset_inv_freq(self) -> None:
        """Recompute the buffer (after the model was materialized from the meta device)."""
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        self._table = None

    def reserve(self, num_positions: int, dtype: torch.dtype) -> None:
        """Precompute the tables of positions [0, num_positions) in dtype. forward then gathers
        their rows (a clamp and a gather) instead of computing them (nine small kernels, ~15 us of
        an 8B verify step on the H200), the same values bit for bit: the same fp32 operations per
        position. Real positions must stay below num_positions (the runner's session length);
        a padding row past it (a static prefill's, near the end of the context) reads the last
        row, and its output is dropped anyway."""
        positions = torch.arange(num_positions, device=self.inv_freq.device)
        self._table = torch.cat(self._compute(positions, dtype), dim=-1)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos [T, D], signed sin [T, D]): cos as transformers', sin with its first half negated
        (see apply_rotary), once per forward for every layer. From the table the two are views of
        one [T, 2D] gather (row stride 2D, as the kernels accept)."""
        table = self._table
        if table is None or table.dtype != dtype or table.device != positions.device:
            return self._compute(positions, dtype)
        rows = table.index_select(0, positions.clamp(max=table.shape[0] - 1))  # [T, 2D]
        half = rows.shape[1] // 2
        return rows[:, :half], rows[:, half:]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, signed_sin: [T, D] from RotaryEmbedding.

    transformers' rotate-half convention, x * cos + cat(-x2, x1) * sin, written as
    x * cos + cat(x2, x1) * cat(-sin1, sin2) (the sign moved into the table, exact): swapping the
    halves is one flip, and the multiply-add one addcmul, instead of neg + cat + mul + mul + add.
    """
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # cat(x2, x1)
    return torch.addcmul(x * cos[:, None], swapped, signed_sin[:, None])


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaArchConfig, layer_id: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        self.scale = d ** -0.5
        self.sliding_window = config.layer_sliding_window(layer_id)
        # [(Hq + 2 Hkv) * D, H]: rows q, then k, then v (checkpoint names q/k/v_proj on disk).
        self.qkv_proj = MergedLinear(h, {"q_proj": self.num_heads * d, "k_proj": self.num_kv_heads * d,
                                         "v_proj": self.num_kv_heads * d},
                                     bias=config.attention_bias, dtype=dtype)
        self.o_proj = Linear(self.num_heads * d, h, bias=config.o_proj_bias, dtype=dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.tp_group = None  # set by tensor_parallel.shard_llama_: o_proj is then row-parallel

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, H] (normed) -> q [T, Hq, D], k [T, Hkv, D] (normed, rotated), v [T, Hkv, D]."""
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)  # q and k heads side by side
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])), dim=1)
        qk = apply_rotary(qk, cos, sin)  # one RoPE over q and k heads together
        q, k = qk.split((hq, hkv), dim=1)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """Write k/v into the cache, attend; [T, Hq * D] (before o_proj)."""
        write_kv(cache_k, cache_v, k, v, meta.slot_mapping)
        # The fixed (CUDA-graph) layout or the varlen one; both take and return [T, Hq, D].
        attend = static_paged_attention if isinstance(meta, StaticAttentionMetadata) else paged_attention
        out = attend(q, cache_k, cache_v, meta, self.scale, self.sliding_window)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """[T, Hq * D] -> [T, H]."""
        return row_parallel(self.o_proj, attn, self.tp_group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        return self.output(self.attend(*self.project(x, cos, sin), meta, cache_k, cache_v))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one fused GEMM."""

    def __init__(self, config: LlamaArchConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        # [2 I, H]: rows gate, then up (checkpoint names gate_proj / up_proj on disk).
        self.gate_up_proj = MergedLinear(h, {"gate_proj": i, "up_proj": i}, bias=bias, dtype=dtype)
        self.down_proj = Linear(i, h, bias=bias, dtype=dtype)

        self.tp_group = None  # set by tensor_parallel.shard_llama_: down_proj is then row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return row_parallel(self.down_proj, F.silu(gate) * up, self.tp_group)


def _attention_input(layer: "LlamaDecoderLayer", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Region before attention: input RMSNorm, fused QKV, q/k norms, RoPE -> (q, k, v)."""
    return layer.self_attn.project(layer.input_layernorm(x), cos, sin)


def _attention_output_and_mlp(layer: "LlamaDecoderLayer", x: torch.Tensor, attn: torch.Tensor
                              ) -> torch.Tensor:
    """Region after attention: o_proj + residual, post-attention RMSNorm, MLP + residual."""
    x = x + layer.self_attn.output(attn)
    return x + layer.mlp(layer.post_attention_layernorm(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaArchConfig, layer_id: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, meta, cache_k, cache_v):
        q, k, v = _attention_input(self, x, cos, sin)
        attn = self.self_attn.attend(q, k, v, meta, cache_k, cache_v)  # writes the cache
        return _attention_output_and_mlp(self, x, attn)


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
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
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
    targets = checkpoint_tensors(model)  # checkpoint name -> parameter, or its rows of a fused one
    loaded: set[str] = set()
    for name, tensor in iter_tensors(model_dir):
        target = targets.get(name)
        if target is None:
            continue  # e.g. rotary inv_freq of old checkpoints, MTP heads: not ours
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} "
                             f"!= model shape {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)
    missing = set(targets) - loaded
    if config.tie_word_embeddings:
        # One copy of the tied matrix is enough (checkpoints usually store only the embedding).
        loaded_embed = "model.embed_tokens.weight" in loaded
        missing.discard("lm_head.weight" if loaded_embed else "model.embed_tokens.weight")
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors: {sorted(missing)[:8]}"
                         + (" ..." if len(missing) > 8 else ""))
    return model.eval()
