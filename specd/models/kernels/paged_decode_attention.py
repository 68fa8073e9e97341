"""Split-KV paged attention for the static (CUDA-graph) layout, in Triton (flash-decoding).

The layout is static_attention.py's: B slots of Q rows, slot b's row i at position ctx[b] + i
attending keys 0..ctx[b] + i (and, with a sliding window w, only keys > ctx[b] + i - w), keys read
straight from the paged cache through the block table: no gather, no mask tensor, no copies.

Why split-KV: at small batch there are only B * Hkv (batch 1: 8) (sequence, KV head) pairs, far
fewer than the GPU's 132 multiprocessors, and each pair's keys are read serially. So the keys of
a pair are cut into SPLITS chunks, one program each (grid [B, Hkv, SPLITS]); every program returns
its chunk's softmax partials (running max m, sum l, unnormalised output acc), and a second kernel
merges the chunks (exact: the log-sum-exp combination). GQA: the G = Hq / Hkv query heads that share
a KV head and the Q rows of a slot form one [G * Q, D] tile, so each K/V tile is read once for all
of them and the score tile is a tensor-core product.

The PyTorch twin (static_attention.static_paged_attention's gather + SDPA) is the reference the
tests compare against, on CPU through Triton's interpreter.
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

MAX_QUERY_LEN = 16  # rows per slot this kernel serves: verify (k + 1) and decode; not prefills
TARGET_PROGRAMS = 264  # ~2 per multiprocessor on an H200 (132): enough key chunks in flight
TARGET_PROGRAMS_ENV = "SPECD_ATTN_PROGRAMS"  # an override for experiments (read at capture time)
MIN_CHUNK_TILES = 1


def num_splits(batch: int, num_kv_heads: int, width: int, block_n: int) -> int:
    """Key chunks per (slot, KV head): fill ~TARGET_PROGRAMS programs, never below one key tile."""
    target = int(os.environ.get(TARGET_PROGRAMS_ENV) or TARGET_PROGRAMS)
    if target < 1:
        raise ValueError(f"{TARGET_PROGRAMS_ENV}: expected a positive number of programs, got {target}")
    tiles = -(-width // block_n)
    want = -(-target // (batch * num_kv_heads))
    return max(1, min(tiles, want))


if triton is not None:
    from specd.models.kernels.pdl import gdc_wait_and_release

    @triton.jit
    def _partials_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, acc_ptr, ml_ptr,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
                         scale, window, tiles_per_split,
                         QLEN: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         USE_PDL: tl.constexpr):
        b = tl.program_id(0)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        num_kv = tl.num_programs(1)
        num_splits = tl.num_programs(2)
        first = split * tiles_per_split * BLOCK_N
        table_row = tables_ptr + b * stride_tb
        # ctx and the block table come from the step's host copy, which completed before the
        # graph's first kernel, not from the kernel before this one: read them before the wait,
        # so their two dependent memory latencies overlap that kernel's tail (pdl.py).
        ctx = tl.load(ctx_ptr + b)
        block = tl.load(table_row + first // BLOCK_SIZE, mask=first < ctx + QLEN, other=0)
        gdc_wait_and_release(USE_PDL)
        r = tl.arange(0, ROWS)  # tile row r = g * QLEN + i: query head kv * GROUP + g, row i
        g = r // QLEN
        i = r % QLEN
        row_ok = r < GROUP * QLEN
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (b * QLEN + i)[:, None] * stride_qt + (kv * GROUP + g)[:, None] * stride_qh
                    + d[None, :], mask=row_ok[:, None], other=0.0)  # [ROWS, D]
        q_pos = ctx + i  # [ROWS] absolute position of each row
        m = tl.full((ROWS,), float("-inf"), tl.float32)
        l = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, D), tl.float32)
        key_end = ctx + QLEN  # no row sees a key at or past ctx + Q
        last = tl.minimum(first + tiles_per_split * BLOCK_N, key_end)
        for start in range(first, last, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions, all in one cache block
            offs = block * stride_kb + (n % BLOCK_SIZE) * stride_ks + kv * stride_kh  # [BLOCK_N]
            k = tl.load(k_ptr + offs[:, None] + d[None, :])  # [BLOCK_N, D]
            v = tl.load(v_ptr + offs[:, None] + d[None, :])  # [BLOCK_N, D], in flight with k
            # the next tile's block number now, not after this tile's arithmetic
            nxt = start + BLOCK_N
            block = tl.load(table_row + nxt // BLOCK_SIZE, mask=nxt < last, other=0)
            s = tl.dot(q, tl.trans(k)) * scale  # [ROWS, BLOCK_N] float32
            allowed = n[None, :] <= q_pos[:, None]
            if HAS_WINDOW:
                allowed = allowed & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # Rows with nothing allowed yet keep m = -inf: use 0 there so exp() gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        base = ((b * num_kv + kv) * num_splits + split) * ROWS
        tl.store(acc_ptr + (base + r)[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + (base + r) * 2, m)
        tl.store(ml_ptr + (base + r) * 2 + 1, l)

    @triton.jit
    def _combine_kernel(acc_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, num_splits,
                        QLEN: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                        SPLITS_POW2: tl.constexpr, USE_PDL: tl.constexpr):
        gdc_wait_and_release(USE_PDL)
        b = tl.program_id(0)
        kv = tl.program_id(1)
        r = tl.program_id(2)  # one tile row (query head kv * GROUP + r // QLEN, row r % QLEN)
        num_kv = tl.num_programs(1)
        sp = tl.arange(0, SPLITS_POW2)
        sp_ok = sp < num_splits
        base = ((b * num_kv + kv) * num_splits + sp) * ROWS + r  # [SPLITS_POW2]
        m = tl.load(ml_ptr + base * 2, mask=sp_ok, other=float("-inf"))
        l = tl.load(ml_ptr + base * 2 + 1, mask=sp_ok, other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # [SPLITS_POW2]
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + base[:, None] * D + d[None, :], mask=sp_ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)  # [D]
        g = r // QLEN
        i = r % QLEN
        tl.store(out_ptr + (b * QLEN + i) * stride_ot + (kv * GROUP + g) * stride_oh + d,
                 out.to(out_ptr.dtype.element_ty))


def serves_query_len(query_len: int) -> bool:
    """Whether this kernel takes a slot of query_len rows: its one [G * Q, D] tile per program is
    sized for verify and decode; a prefill's Q (the static path's, cuda_graphs.py) goes to
    static_attention's SDPA twin instead."""
    return query_len <= MAX_QUERY_LEN


def kernel_applies(q: torch.Tensor, cache_k: torch.Tensor) -> bool:
    """Triton present, CUDA (or the interpreter), fp16/bf16, a power-of-two head_dim >= 16."""
    head_dim = q.shape[-1]
    return (triton is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and q.dtype in (torch.float16, torch.bfloat16) and cache_k.dtype == q.dtype
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and q.stride(-1) == 1
            and cache_k.is_contiguous())


def paged_decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           ctx_lens: torch.Tensor, block_tables: torch.Tensor, query_len: int,
                           scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [B * Q, Hq, D] (row stride free: a view into the fused qkv output is fine);
    cache_k/v: [num_blocks, block_size, Hkv, D]; ctx_lens: [B]; block_tables: [B, NB].
    Returns [B * Q, Hq, D] in q's dtype."""
    rows, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = cache_k.shape
    batch = ctx_lens.shape[0]
    group = num_heads // num_kv_heads
    assert rows == batch * query_len and block_tables.stride(1) == 1, (q.shape, block_tables.shape)
    tile_rows = max(16, triton.next_power_of_2(group * query_len))
    block_n = min(64, block_size) if block_size >= 16 else 16
    assert block_size % block_n == 0, f"block_size {block_size}: a multiple of {block_n} expected"
    width = block_tables.shape[1] * block_size
    splits = num_splits(batch, num_kv_heads, width, block_n)
    tiles_per_split = -(-(-(-width // block_n)) // splits)
    acc = torch.empty((batch, num_kv_heads, splits, tile_rows, head_dim), dtype=torch.float32,
                      device=q.device)
    ml = torch.empty((batch, num_kv_heads, splits, tile_rows, 2), dtype=torch.float32, device=q.device)
    pdl = use_pdl(q)
    _partials_kernel[(batch, num_kv_heads, splits)](
        q, cache_k, cache_v, block_tables, ctx_lens, acc, ml,
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        block_tables.stride(0), scale, sliding_window or 0, tiles_per_split,
        QLEN=query_len, GROUP=group, ROWS=tile_rows, D=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, num_warps=4, num_stages=2, **launch_options(pdl))
    out = torch.empty((rows, num_heads, head_dim), dtype=q.dtype, device=q.device)
    _combine_kernel[(batch, num_kv_heads, group * query_len)](
        acc, ml, out, out.stride(0), out.stride(1), splits,
        QLEN=query_len, GROUP=group, ROWS=tile_rows, D=head_dim,
        SPLITS_POW2=triton.next_power_of_2(splits), num_warps=1, **launch_options(pdl))
    return out
