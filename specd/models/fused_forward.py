"""The static (CUDA-graph) step's model forward through specd's Triton kernels.

Per decoder layer: RMSNorm (fused with the previous layer's residual add) and the fused QKV GEMM;
split-KV paged attention with RoPE and the new tokens' cache write folded in
(kernels/paged_decode_attention.py; the flash-attn path and the prefill's SDPA run
kernels/rope_cache.py first); o_proj; residual add + RMSNorm and the gate/up GEMM with silu * up in
its epilogue; down_proj. The GEMMs take the skinny kernel at few rows (linear.py), o_proj and
down_proj split-K where skinny_gemm.split_k_for says so (fp32 partials the next norm sums). Eight
launches a layer where the PyTorch path takes about thirty, and no gathered K/V copies. On Hopper
the kernels launch with PDL (kernels/pdl.py).

It computes what LlamaForCausalLM.forward computes (the deferred residual add changes no value:
layer i's first norm materialises the residual entering it, which is also what the aux features
capture). `applies` says when: CUDA (or Triton's interpreter, for the CPU tests), fp16/bf16, no
q/k norms, no tensor parallelism, a power-of-two head_dim; otherwise StaticForward runs the PyTorch
body (the twin the tests compare with).
"""

from __future__ import annotations

import torch

from specd.models import skinny_gemm
from specd.models.kernels import norm_act, paged_decode_attention, rope_cache
from specd.models.kv_cache import PagedKVCache
from specd.models.linear import takes_skinny_kernel
from specd.models.static_attention import StaticAttentionMetadata, flash_kvcache_applies, static_paged_attention


def applies(model, kv_cache: PagedKVCache) -> bool:
    config = model.config
    layer = model.model.layers[0]
    probe = kv_cache.k_caches[0]
    q_like = probe.new_empty((1, config.num_attention_heads, config.head_dim))
    return (layer.self_attn.q_norm is None and layer.self_attn.tp_group is None
            and layer.mlp.tp_group is None
            and paged_decode_attention.kernel_applies(q_like, probe)
            and rope_cache.kernel_applies(probe.new_empty((1, 8)), probe, config.head_dim)
            and norm_act.kernel_applies(probe.new_empty((1, config.hidden_size))))


def fused_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, meta: StaticAttentionMetadata,
                  kv_cache: PagedKVCache, aux_layer_ids: tuple[int, ...] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LlamaForCausalLM.forward's contract: (hidden [T, H] after the final norm, aux or None)."""
    config = model.config
    eps = config.rms_norm_eps
    x = model.model.embed_tokens(input_ids)  # [T, H]
    cos, sin = model.model.rotary_emb(positions, x.dtype)  # [T, D] each
    tokens = x.shape[0]
    wanted = set(aux_layer_ids)
    captured: dict[int, torch.Tensor] = {}
    delta = None  # the previous layer's MLP output, added to x by this layer's first norm
    layers = model.model.layers
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        x, qkv = _norm_project(x, delta, layer.input_layernorm.weight, eps, attn.qkv_proj)
        if i in wanted:
            captured[i] = x
        o = _attention(attn, qkv, cos, sin, meta, kv_cache, i).reshape(tokens, -1)
        attn_out = _residual_delta(attn.o_proj, o)
        x, act = _norm_project(x, attn_out, layer.post_attention_layernorm.weight, eps, mlp.gate_up_proj, swiglu=True)
        delta = _residual_delta(mlp.down_proj, act)
    _, hidden = norm_act.rms_norm(x, model.model.norm.weight, eps, delta)
    aux = torch.cat([captured[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
    return hidden, aux


def _attention(attn, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: StaticAttentionMetadata,
               kv_cache: PagedKVCache, layer: int) -> torch.Tensor:
    """Layer `layer`'s attention of the new tokens' qkv [T, (Hq + 2 Hkv) D], their k/v written to
    the paged cache first: [T, Hq, D]."""
    cache_k, cache_v = kv_cache.k_caches[layer], kv_cache.v_caches[layer]
    # flash-attn installed and 256-token blocks: its kernel; a prefill's Q rows (static
    # prefill, cuda_graphs.py) overflow the decode kernel's tile: the PyTorch twin (SDPA)
    other_attention = (flash_kvcache_applies(qkv, meta)
                       or not paged_decode_attention.serves_query_len(meta.query_len))
    if not other_attention:  # RoPE and the cache write inside the attention kernel
        return paged_decode_attention.rope_paged_decode_attention(
            qkv, cos, sin, meta.slot_mapping, cache_k, cache_v, meta.ctx_lens, meta.block_tables,
            meta.query_len, attn.num_heads, attn.scale, attn.sliding_window)
    q = rope_cache.rope_and_cache_write(qkv, cos, sin, meta.slot_mapping, cache_k, cache_v,
                                        attn.num_heads, attn.num_kv_heads)  # [T, Hq, D]
    return static_paged_attention(q, cache_k, cache_v, meta, attn.scale, attn.sliding_window)


def _norm_project(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, proj,
                  swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual x + delta, proj(RMSNorm(residual))), silu(gate) * up of it with swiglu: the norm
    kernel, then the product."""
    x, h = norm_act.rms_norm(x, norm_weight, eps, delta)
    return x, (_swiglu(proj, h) if swiglu else proj(h))


def _residual_delta(proj, h: torch.Tensor) -> torch.Tensor:
    """proj(h) as an rms_norm delta: fp32 split-K partials [S, T, N] where the skinny kernel takes
    the product (few rows, "auto" backend), there is no bias and split_k_for(N, K) > 1; else
    proj(h) [T, N] (S = 1 would only add an fp32 round trip)."""
    if proj.bias is None and takes_skinny_kernel(h, proj.weight):
        splits = skinny_gemm.split_k_for(*proj.weight.shape)
        if splits > 1:
            return skinny_gemm.skinny_gemm_partials(h, proj.weight, splits)
    return proj(h)


def _swiglu(gate_up_proj, h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up projection: one kernel where the skinny GEMM takes the
    product (few rows), else the product and then the activation kernel."""
    if gate_up_proj.bias is None and takes_skinny_kernel(h, gate_up_proj.weight):
        return skinny_gemm.skinny_gemm_swiglu(h, gate_up_proj.weight)
    return norm_act.silu_mul(gate_up_proj(h))
