"""Graph-safe paged attention over a fixed batch layout (the CUDA-graph verify / decode step).

`batch` slots of exactly `query_len` (Q) rows: slot b's cache held `ctx_lens[b]` tokens before this
forward, and its row i (position `ctx_lens[b] + i`) attends keys `0 .. ctx_lens[b] + i` (with a
sliding window w, only keys `> ctx_lens[b] + i - w`). A sequence with fewer than Q new tokens fills
its first rows; the rest, and whole padding slots (ctx 0, block table all scratch), write their K/V
to the cache's scratch block and their outputs are discarded (a padding row may attend stale or
scratch keys, always finite; real rows never see them). No shape depends on the batch's contents
and nothing reads a host value, so one capture replays for any batch of its (batch, Q, width).

Two implementations share that contract: flash-attn's `flash_attn_with_kvcache` (CUDA, fp16/bf16,
block size a multiple of 256), and a PyTorch twin that runs everywhere: K/V gathered through the
block table, then one `scaled_dot_product_attention`. SDPA's fused kernels refuse a mask with
`enable_gqa`, and convert a boolean mask in every call, so the twin folds the G = Hq / Hkv query
heads sharing a KV head into G * Q rows of that head (no K/V copied per query head) and uses one
additive mask in the query dtype ([B, 1, G * Q, S]) built once per forward for every layer: the
memory-efficient kernel's input contract, which keeps SDPA off its math kernel on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specd.models.attention import FLASH_PAGE_MULTIPLE

try:  # optional; without it the PyTorch twin runs on CUDA too
    from flash_attn import flash_attn_with_kvcache as _flash_attn_with_kvcache
except Exception:  # ImportError, or a broken CUDA extension
    _flash_attn_with_kvcache = None


@dataclass
class StaticAttentionMetadata:
    """Device tensors of one fixed-layout forward (views into the static input buffer)."""

    ctx_lens: torch.Tensor  # [B] int64, tokens cached before this forward
    block_tables: torch.Tensor  # [B, NB] int64, padded with the scratch block
    slot_mapping: torch.Tensor  # [B * Q] int64, flat cache slot of each row (scratch for padding)
    query_len: int  # Q, rows per batch slot
    block_size: int
    # Masks built by the first layer of a forward, reused by the others.
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def batch(self) -> int:
        return self.ctx_lens.shape[0]

    @property
    def width(self) -> int:
        """Key positions gathered per slot: NB * block_size."""
        return self.block_tables.shape[1] * self.block_size

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, Q, S] bool, True where row i of slot b may attend key column s."""
        key = ("mask", sliding_window)
        if key not in self._cache:
            device = self.ctx_lens.device
            rows = torch.arange(self.query_len, device=device)[None, :, None]  # [1, Q, 1]
            cols = torch.arange(self.width, device=device)[None, None, :]  # [1, 1, S]
            q_pos = self.ctx_lens[:, None, None] + rows  # [B, Q, 1]
            allowed = cols <= q_pos
            if sliding_window is not None:
                allowed = allowed & (cols > q_pos - sliding_window)
            self._cache[key] = allowed[:, None]
        return self._cache[key]

    def attention_bias(self, sliding_window: int | None, group: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, G * Q, S] additive mask for G query heads folded into the rows (row g * Q + i is
        query row i): 0 where allowed, the dtype's minimum elsewhere (every real row keeps key 0,
        so no row is all-masked and softmax stays finite)."""
        key = ("bias", sliding_window, group, dtype)
        if key not in self._cache:
            allowed = self.mask(sliding_window).repeat(1, 1, group, 1)  # [B, 1, G * Q, S]
            zero = torch.zeros((), dtype=dtype, device=allowed.device)
            self._cache[key] = torch.where(allowed, zero, torch.finfo(dtype).min)
        return self._cache[key]


def flash_kvcache_applies(q: torch.Tensor, meta: StaticAttentionMetadata) -> bool:
    return (_flash_attn_with_kvcache is not None and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
            and meta.block_size % FLASH_PAGE_MULTIPLE == 0)


def static_paged_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           meta: StaticAttentionMetadata, scale: float,
                           sliding_window: int | None = None) -> torch.Tensor:
    """Attention of the fixed layout's rows over their caches (new K/V already written).

    q: [B * Q, Hq, D]; cache_k/v: [num_blocks, block_size, Hkv, D]. Returns [B * Q, Hq, D].
    """
    assert q.ndim == 3 and cache_k.ndim == 4, (q.shape, cache_k.shape)
    rows, num_heads, head_dim = q.shape
    batch, qlen = meta.batch, meta.query_len
    assert rows == batch * qlen, f"{rows} rows for {batch} slots of {qlen}"
    q = q.view(batch, qlen, num_heads, head_dim)  # [B, Q, Hq, D]
    if flash_kvcache_applies(q, meta):
        # flash-attn aligns the causal mask bottom-right: Q rows ending at cache_seqlens, which
        # is ctx + Q in our layout (rows i < q_len land exactly on ctx + i).
        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        out = _flash_attn_with_kvcache(
            q, cache_k, cache_v, cache_seqlens=(meta.ctx_lens + qlen).to(torch.int32),
            block_table=meta.block_tables.to(torch.int32), softmax_scale=scale, causal=True,
            window_size=window)  # [B, Q, Hq, D]
        return out.reshape(rows, num_heads, head_dim)
    num_kv_heads = cache_k.shape[2]
    group = num_heads // num_kv_heads
    k = cache_k[meta.block_tables].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
    v = cache_v[meta.block_tables].flatten(1, 2).transpose(1, 2).to(q.dtype)
    # Fold: query head h = kv * G + g (the repeat_kv pairing) -> row g * Q + i of KV head kv.
    q = q.view(batch, qlen, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, group * qlen, head_dim)  # [B, Hkv, G * Q, D]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=meta.attention_bias(sliding_window, group, q.dtype), scale=scale)
    out = out.view(batch, num_kv_heads, group, qlen, head_dim).permute(0, 3, 1, 2, 4)  # [B, Q, Hkv, G, D]
    return out.reshape(rows, num_heads, head_dim)
