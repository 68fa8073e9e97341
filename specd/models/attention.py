"""Paged attention over flattened variable-length batches.

A batch is the concatenation of chunks, one per sequence: chunk b holds `q_b` new tokens that sit
at the end of that sequence's context of `s_b` tokens (cache included, new tokens included). Query
i of chunk b is at absolute position `s_b - q_b + i` and attends to keys `0 .. s_b - q_b + i`
(and, with a sliding window w, only to keys `> s_b - q_b + i - w`, as transformers does).

Two implementations share that contract:
- `flash_attn_varlen_func` with a block table (CUDA, fp16/bf16, flash-attn 2 installed, block size
  a multiple of 256, which flash-attn 2's paged path requires);
- a PyTorch twin that gathers each sequence's K/V through its block table, pads the batch and runs
  one `scaled_dot_product_attention` with an explicit mask. It is the reference on CPU and the
  fallback whenever the flash path does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specd.models.sdpa_backends import variable_shape_sdpa

try:  # flash-attn is optional; without it every call takes the PyTorch path
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func
except Exception:  # ImportError, or a broken CUDA extension
    _flash_attn_varlen_func = None

FLASH_PAGE_MULTIPLE = 256  # flash-attn 2: paged KV needs page_block_size % 256 == 0


@dataclass
class AttentionMetadata:
    """Where each chunk's queries and keys are, shared by every layer of one forward."""

    query_start_loc: torch.Tensor  # [batch + 1] int32, cu_seqlens_q
    seq_lens: torch.Tensor  # [batch] int32, context length per chunk after the append
    max_query_len: int
    max_seq_len: int
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each new token
    block_size: int
    query_lens_host: list[int] = field(default_factory=list)  # host copies: no device syncs
    seq_lens_host: list[int] = field(default_factory=list)
    # Per-forward tensors of the PyTorch path (padding indices, masks), built by the first layer.
    _fallback: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor,
              slot_mapping: list[int], block_size: int, device: torch.device) -> "AttentionMetadata":
        if len(query_lens) != len(seq_lens) or not query_lens:
            raise ValueError("query_lens and seq_lens must be non-empty and of equal length")
        if any(q < 1 or q > s for q, s in zip(query_lens, seq_lens)):
            raise ValueError(f"need 1 <= query_len <= seq_len per chunk, got {query_lens}, {seq_lens}")
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_tables=block_tables.to(device=device, dtype=torch.int32),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_size=block_size,
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def cu_seqlens_k(self) -> torch.Tensor:  # [batch + 1] int32
        return F.pad(torch.cumsum(self.seq_lens, 0, dtype=torch.int32), (1, 0))


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V in their slots.

    cache_k, cache_v: [num_blocks, block_size, num_kv_heads, head_dim]; k, v: [num_tokens,
    num_kv_heads, head_dim]; slot_mapping: [num_tokens].
    """
    num_blocks, block_size, heads, dim = cache_k.shape
    cache_k.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, k.to(cache_k.dtype))
    cache_v.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, v.to(cache_v.dtype))


def flash_attention_applies(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    return (_flash_attn_varlen_func is not None and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
            and meta.block_size % FLASH_PAGE_MULTIPLE == 0)


def paged_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None
                    ) -> torch.Tensor:
    """Causal attention of the new tokens over their sequences' cached K/V (new K/V written first).

    q: [num_tokens, num_heads, head_dim]; cache_k/v: [num_blocks, block_size, num_kv_heads,
    head_dim]. Returns [num_tokens, num_heads, head_dim].
    """
    assert q.ndim == 3 and cache_k.ndim == 4, (q.shape, cache_k.shape)
    if flash_attention_applies(q, meta):
        return _flash_paged_attention(q, cache_k, cache_v, meta, scale, sliding_window)
    return torch_paged_attention(q, cache_k, cache_v, meta, scale, sliding_window)


def _flash_paged_attention(q, cache_k, cache_v, meta, scale, sliding_window):
    # flash-attn 2 aligns the causal mask bottom-right, exactly our "chunk at the end of the
    # context" rule; window (w - 1, 0) keeps keys with q_pos - k_pos < w.
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
    return _flash_attn_varlen_func(
        q, cache_k, cache_v,
        cu_seqlens_q=meta.query_start_loc,
        cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale,
        causal=True,
        window_size=window,
        block_table=meta.block_tables,
    )


def _padding_layout(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch index, row within chunk) of every flattened token: [num_tokens] each."""
    if "rows" not in meta._fallback:
        lens = torch.tensor(meta.query_lens_host, device=device)
        batch_idx = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
        starts = meta.query_start_loc.to(device=device, dtype=torch.long)[:-1]
        row_idx = torch.arange(int(lens.sum()), device=device) - starts[batch_idx]
        meta._fallback["rows"] = (batch_idx, row_idx)
    return meta._fallback["rows"]


def _mask(meta: AttentionMetadata, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """[batch, 1, max_query_len, max_seq_len] bool, True where a query may attend a key."""
    key = ("mask", sliding_window)
    if key not in meta._fallback:
        q_lens = torch.tensor(meta.query_lens_host, device=device)[:, None, None]  # [B, 1, 1]
        s_lens = torch.tensor(meta.seq_lens_host, device=device)[:, None, None]
        rows = torch.arange(meta.max_query_len, device=device)[None, :, None]  # [1, Q, 1]
        cols = torch.arange(meta.max_seq_len, device=device)[None, None, :]  # [1, 1, S]
        q_pos = s_lens - q_lens + rows  # absolute position of each query row
        allowed = (cols <= q_pos) & (cols < s_lens)
        if sliding_window is not None:
            allowed &= cols > q_pos - sliding_window
        # Padding rows (row >= q_len) are discarded; give them one key so softmax stays finite.
        allowed |= (rows >= q_lens) & (cols == 0)
        meta._fallback[key] = allowed[:, None]
    return meta._fallback[key]


def torch_paged_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                          meta: AttentionMetadata, scale: float, sliding_window: int | None = None
                          ) -> torch.Tensor:
    """The PyTorch twin of the flash path: gather, pad, one SDPA call, unpad."""
    num_tokens, num_heads, head_dim = q.shape
    batch = len(meta.query_lens_host)
    batch_idx, row_idx = _padding_layout(meta, q.device)
    q_pad = q.new_zeros(batch, meta.max_query_len, num_heads, head_dim)  # [B, Q, Hq, D]
    q_pad[batch_idx, row_idx] = q
    # Gather whole blocks through the block table, then cut to the longest context.
    max_blocks = -(-meta.max_seq_len // meta.block_size)
    tables = meta.block_tables[:, :max_blocks].long()  # [B, nb]
    k = cache_k[tables].flatten(1, 2)[:, :meta.max_seq_len]  # [B, S, Hkv, D]
    v = cache_v[tables].flatten(1, 2)[:, :meta.max_seq_len]
    with variable_shape_sdpa():  # no cuDNN: a plan per new padded shape (sdpa_backends.py)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
            attn_mask=_mask(meta, sliding_window, q.device), scale=scale,
            enable_gqa=k.shape[2] != num_heads,
        )  # [B, Hq, Q, D]
    return out.transpose(1, 2)[batch_idx, row_idx]  # [num_tokens, Hq, D]
