"""RoPE on q and k, and the paged-cache write of k and v, in one Triton kernel.

After the fused QKV GEMM, the eager path spends about ten small kernels per layer on this (the
slices, the rotate-half flip, multiply-add, the casts, two index_copy_ writes); at batch 1 each is a
few microseconds of an almost empty GPU. Here one program per (token, head) reads its head's row
of the qkv output once: a q head is rotated into q_out, a KV head's k is rotated and written with
its v straight into the token's cache slot.

Same arithmetic as llama.apply_rotary (x * cos + cat(x2, x1) * signed_sin, the tables from
RotaryEmbedding) in float32, rounded once to the cache dtype; the tests compare it with that
PyTorch path on CPU through Triton's interpreter.
"""

from __future__ import annotations

import os

import torch

from specd.models.kernels.pdl import launch_options, use_pdl

try:
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install
    triton = None


if triton is not None:
    from specd.models.kernels.pdl import gdc_wait_and_release

    @triton.jit
    def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                           stride_qkv, stride_cos, stride_qo_t, stride_qo_h, stride_slot, stride_cache_h,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                           USE_PDL: tl.constexpr):
        gdc_wait_and_release(USE_PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)  # 0..Hq-1: a q head; Hq..Hq+Hkv-1: a KV head
        j = tl.arange(0, HALF)
        cos1 = tl.load(cos_ptr + t * stride_cos + j).to(tl.float32)
        cos2 = tl.load(cos_ptr + t * stride_cos + HALF + j).to(tl.float32)
        sin1 = tl.load(sin_ptr + t * stride_cos + j).to(tl.float32)  # signed: -sin
        sin2 = tl.load(sin_ptr + t * stride_cos + HALF + j).to(tl.float32)
        row = qkv_ptr + t * stride_qkv + h * 2 * HALF
        x1 = tl.load(row + j).to(tl.float32)
        x2 = tl.load(row + HALF + j).to(tl.float32)
        out1 = x1 * cos1 + x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
        if h < NUM_HEADS:
            q_dst = q_out_ptr + t * stride_qo_t + h * stride_qo_h
            tl.store(q_dst + j, out1.to(q_out_ptr.dtype.element_ty))
            tl.store(q_dst + HALF + j, out2.to(q_out_ptr.dtype.element_ty))
        else:
            kv = h - NUM_HEADS
            slot = tl.load(slots_ptr + t)
            offset = slot * stride_slot + kv * stride_cache_h
            tl.store(k_cache_ptr + offset + j, out1.to(k_cache_ptr.dtype.element_ty))
            tl.store(k_cache_ptr + offset + HALF + j, out2.to(k_cache_ptr.dtype.element_ty))
            v_row = qkv_ptr + t * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + kv) * 2 * HALF
            v1 = tl.load(v_row + j)
            v2 = tl.load(v_row + HALF + j)
            tl.store(v_cache_ptr + offset + j, v1.to(v_cache_ptr.dtype.element_ty))
            tl.store(v_cache_ptr + offset + HALF + j, v2.to(v_cache_ptr.dtype.element_ty))


def kernel_applies(qkv: torch.Tensor, cache_k: torch.Tensor, head_dim: int) -> bool:
    return (triton is not None and (qkv.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and qkv.dtype in (torch.float16, torch.bfloat16) and qkv.stride(-1) == 1
            and head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0
            and cache_k.is_contiguous())


def rope_and_cache_write(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                         slot_mapping: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                         num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) * D] (rows q heads, k heads, v heads); cos/signed_sin: [T, D];
    slot_mapping: [T]; cache_k/v: [num_blocks, block_size, Hkv, D]. Writes rotated k and v into
    the slots; returns rotated q [T, Hq, D]."""
    tokens = qkv.shape[0]
    head_dim = cache_k.shape[-1]
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q_out
    assert cos.stride(-1) == 1 and cos.stride() == signed_sin.stride(), (cos.stride(), signed_sin.stride())
    assert slot_mapping.stride(0) == 1 and cache_k.stride() == cache_v.stride()
    _rope_cache_kernel[(tokens, num_heads + num_kv_heads)](
        qkv, cos, signed_sin, slot_mapping, q_out, cache_k, cache_v,
        qkv.stride(0), cos.stride(0), q_out.stride(0), q_out.stride(1),
        cache_k.stride(1), cache_k.stride(2),  # a slot (block * block_size + offset) is one row step
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, num_warps=1,
        **launch_options(use_pdl(qkv)))
    return q_out
