"""Split-KV paged attention for the static (CUDA-graph) layout, in Triton (flash-decoding).

The layout is static_attention.py's: B slots of Q rows, slot b's row i at position ctx[b] + i
attending keys 0..ctx[b] + i (with a sliding window w, only keys > ctx[b] + i - w), read straight
from the paged cache through the block table: no gather, no mask tensor, no copies.

Why split-KV: at small batch there are only B * Hkv (batch 1: 8) (sequence, KV head) pairs, far
fewer than the GPU's 132 SMs. So a pair's keys are cut into SPLITS chunks, one program each (grid
[B, Hkv, SPLITS]), each returning softmax partials (max m, sum l, unnormalised acc), and a second
kernel merges them exactly (log-sum-exp), split by split in order, elementwise, so the sum's order
never depends on the kernel. The G = Hq / Hkv query heads of a KV head and a slot's Q rows form one
[G * Q, D] tile: each K/V tile is read once for all and the scores are a tensor-core product.

rope_paged_decode_attention (what the verify step runs) also does RoPE and the new tokens' cache
write (kernels/rope_cache.py's arithmetic, the same bits): one launch less a layer. Each program
rotates its q tile, and the program whose key chunk holds a new token's position writes that
token's k and v before its key loop (the chunks partition the keys, so each is written once).
paged_decode_attention takes q rotated and cached (the draft heads, head_kv.py). The PyTorch twin
(static_attention.static_paged_attention) is the tests' reference, on CPU through the interpreter.
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
MIN_CHUNK_TILES = 1


def num_splits(batch: int, num_kv_heads: int, width: int, block_n: int) -> int:
    """Key chunks per (slot, KV head): fill ~TARGET_PROGRAMS programs, never below one key tile."""
    tiles = -(-width // block_n)
    want = -(-TARGET_PROGRAMS // (batch * num_kv_heads))
    return max(1, min(tiles, want))


if triton is not None:
    from specd.models.kernels.pdl import gdc_wait_and_release

    @triton.jit
    def _rope_tables(cos_ptr, sin_ptr, tok, d, mask, stride_cos):
        """cos and signed sin of tokens tok [R]: float32 [R, D] each. They are computed from the
        positions before the step's first layer, long finished when any attention kernel starts (a
        PDL kernel overlaps only its predecessor): loads that may come before the wait."""
        offs = tok[:, None] * stride_cos + d[None, :]
        cos = tl.load(cos_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)
        return cos, sin

    @triton.jit
    def _load_roped(head_ptrs, d, cos, sin, mask, D: tl.constexpr):
        """rope_cache's arithmetic on heads of qkv (head_ptrs [R, 1], each at a head's first
        element): float32 x * cos + x_swapped * signed_sin, x_swapped[d] = x[(d + D / 2) % D]."""
        x = tl.load(head_ptrs + d[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
        x_swapped = tl.load(head_ptrs + ((d + D // 2) % D)[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
        return x * cos + x_swapped * sin

    @triton.jit
    def _write_new_kv(qkv_ptr, k_ptr, v_ptr, tok, slot, mine, kv, num_heads, num_kv, d, cos, sin,
                      stride_qt, stride_qh, stride_ks, stride_kh, D: tl.constexpr):
        """What rope_cache does for KV head kv of the tokens tok [R] where mine: k rotated and
        rounded once, v copied, both into the token's slot."""
        row = qkv_ptr + tok[:, None] * stride_qt
        k = _load_roped(row + (num_heads + kv) * stride_qh, d, cos, sin, mine, D)
        v = tl.load(row + (num_heads + num_kv + kv) * stride_qh + d[None, :], mask=mine[:, None])
        dst = (slot * stride_ks + kv * stride_kh)[:, None] + d[None, :]
        tl.store(k_ptr + dst, k.to(k_ptr.dtype.element_ty), mask=mine[:, None])
        tl.store(v_ptr + dst, v.to(v_ptr.dtype.element_ty), mask=mine[:, None])

    @triton.jit
    def _weighted_split(acc_ptr, ml_ptr, row, m_max, d, D: tl.constexpr):
        """One split's acc [R, D] and l [R] at tile rows row [R], weighted exp(m - m_max) (a
        chunk with no keys weighs 0)."""
        m = tl.load(ml_ptr + row * 2, cache_modifier=".cg")
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
        acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], cache_modifier=".cg")
        return acc * w[:, None], tl.load(ml_ptr + row * 2 + 1, cache_modifier=".cg") * w

    @triton.jit
    def _merge_splits(acc_ptr, ml_ptr, pair, r, d, SPLITS: tl.constexpr, ROWS: tl.constexpr,
                      D: tl.constexpr):
        """The log-sum-exp merge of pair's SPLITS partials, tile rows r [R]: [R, D] float32. Split
        by split in split order, elementwise only (module doc); unrolled so that all the loads are
        independent. .cg: from L2 (another kernel's partials: nothing to gain from L1)."""
        base = pair * SPLITS * ROWS + r  # [R]: split s's row r at base + s * ROWS
        m_max = tl.load(ml_ptr + base * 2, cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):
            m_max = tl.maximum(m_max, tl.load(ml_ptr + (base + s * ROWS) * 2, cache_modifier=".cg"))
        num, den = _weighted_split(acc_ptr, ml_ptr, base, m_max, d, D)  # not 0 + x: that turns -0 to +0
        for s in tl.static_range(1, SPLITS):
            part, part_l = _weighted_split(acc_ptr, ml_ptr, base + s * ROWS, m_max, d, D)
            num = num + part
            den = den + part_l
        return num / den[:, None]

    @triton.jit
    def _store_rows(out_ptr, out, b, kv, r, d, stride_ot, stride_oh,
                    QLEN: tl.constexpr, GROUP: tl.constexpr):
        """out [R, D] of tile rows r into [B * Q, Hq, D]: row r = g * QLEN + i is query head
        kv * GROUP + g of row i."""
        g = r // QLEN
        i = r % QLEN
        ptrs = out_ptr + (b * QLEN + i)[:, None] * stride_ot + (kv * GROUP + g)[:, None] * stride_oh + d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=(r < GROUP * QLEN)[:, None])

    @triton.jit
    def _partials_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, acc_ptr, ml_ptr,
                         cos_ptr, sin_ptr, slots_ptr,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_cos,
                         scale, window, tiles_per_split,
                         QLEN: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         ROPE: tl.constexpr, USE_PDL: tl.constexpr):
        """ROPE: q_ptr is the qkv output (q heads, k heads, v heads of D each, stride_qh = D), see
        the module doc; else the rotated q. acc/ml get the partials for _combine_kernel."""
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
        r = tl.arange(0, ROWS)  # tile row r = g * QLEN + i: query head kv * GROUP + g, row i
        g = r // QLEN
        i = r % QLEN
        row_ok = r < GROUP * QLEN
        d = tl.arange(0, D)
        if ROPE:
            # Tile row r < QLEN also stands for new token r (position ctx + r): this program's if
            # the position is in its key chunk; the last split also takes any past the chunks' end
            # (none where the block table covers ctx + Q, as static layouts' do, padding slots too).
            new_pos = ctx + r
            chunk_end = tl.where(split == num_splits - 1, ctx + QLEN, first + tiles_per_split * BLOCK_N)
            mine = (r < QLEN) & (new_pos >= first) & (new_pos < chunk_end)
            q_cos, q_sin = _rope_tables(cos_ptr, sin_ptr, b * QLEN + i, d, row_ok, stride_cos)
            k_cos, k_sin = _rope_tables(cos_ptr, sin_ptr, b * QLEN + r, d, mine, stride_cos)
            slot = tl.load(slots_ptr + b * QLEN + r, mask=mine, other=0)  # host-copied too
        gdc_wait_and_release(USE_PDL)
        q_heads = q_ptr + (b * QLEN + i)[:, None] * stride_qt + (kv * GROUP + g)[:, None] * stride_qh
        if ROPE:
            q = _load_roped(q_heads, d, q_cos, q_sin, row_ok, D).to(q_ptr.dtype.element_ty)  # [ROWS, D]
            _write_new_kv(q_ptr, k_ptr, v_ptr, b * QLEN + r, slot, mine, kv, GROUP * num_kv, num_kv, d,
                          k_cos, k_sin, stride_qt, stride_qh, stride_ks, stride_kh, D)
            tl.debug_barrier()  # the key loop's threads read what the other threads just wrote
        else:
            q = tl.load(q_heads + d[None, :], mask=row_ok[:, None], other=0.0)  # [ROWS, D]
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
        pair = b * num_kv + kv
        base = (pair * num_splits + split) * ROWS
        tl.store(acc_ptr + (base + r)[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + (base + r) * 2, m)
        tl.store(ml_ptr + (base + r) * 2 + 1, l)

    @triton.jit
    def _combine_kernel(acc_ptr, ml_ptr, out_ptr, stride_ot, stride_oh,
                        QLEN: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                        SPLITS: tl.constexpr, USE_PDL: tl.constexpr):
        gdc_wait_and_release(USE_PDL)
        b = tl.program_id(0)
        kv = tl.program_id(1)
        r = tl.program_id(2) + tl.arange(0, 1)  # one tile row, as a [1] tile for the shared helpers
        pair = b * tl.num_programs(1) + kv
        d = tl.arange(0, D)
        out = _merge_splits(acc_ptr, ml_ptr, pair, r, d, SPLITS, ROWS, D)
        _store_rows(out_ptr, out, b, kv, r, d, stride_ot, stride_oh, QLEN, GROUP)


def serves_query_len(query_len: int) -> bool:
    """Whether this kernel takes a slot of query_len rows: its one [G * Q, D] tile per program is
    sized for verify and decode; a prefill's Q (the static path's, cuda_graphs.py) goes to
    static_attention's SDPA twin instead."""
    return query_len <= MAX_QUERY_LEN


def kernel_applies(q: torch.Tensor, cache_k: torch.Tensor) -> bool:
    """Triton present, CUDA (or the interpreter), fp16/bf16, a power-of-two head_dim >= 16, KV
    blocks of a multiple of 16 tokens (the key tile; a smaller --cache-block-seq-len takes the
    PyTorch body instead of failing at the first forward)."""
    head_dim = q.shape[-1]
    block_size = cache_k.shape[1] if cache_k.ndim == 4 else 0
    return (triton is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and q.dtype in (torch.float16, torch.bfloat16) and cache_k.dtype == q.dtype
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and q.stride(-1) == 1
            and cache_k.is_contiguous() and block_size >= 16 and block_size % min(64, block_size) == 0)


def paged_decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           ctx_lens: torch.Tensor, block_tables: torch.Tensor, query_len: int,
                           scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [B * Q, Hq, D] (row stride free: a view into the fused qkv output is fine);
    cache_k/v: [num_blocks, block_size, Hkv, D]; ctx_lens: [B]; block_tables: [B, NB].
    Returns [B * Q, Hq, D] in q's dtype."""
    return _attention(q, q.shape[1], q.stride(0), q.stride(1), None, cache_k, cache_v, ctx_lens,
                      block_tables, query_len, scale, sliding_window)


def rope_paged_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                                slot_mapping: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                                ctx_lens: torch.Tensor, block_tables: torch.Tensor, query_len: int,
                                num_heads: int, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """rope_cache.rope_and_cache_write then paged_decode_attention, in the attention kernel.

    qkv: [T, (Hq + 2 Hkv) * D] (q heads, k heads, v heads), T = B * Q; cos/signed_sin: [T, D];
    slot_mapping: [T]; the rest as paged_decode_attention. Writes the rotated k and v of the T
    tokens into their slots; returns the attention of the rotated q, [T, Hq, D] in qkv's dtype."""
    head_dim, num_kv_heads = cache_k.shape[-1], cache_k.shape[-2]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(-1) == 1, qkv.shape
    assert cos.stride(-1) == 1 and cos.stride() == signed_sin.stride(), (cos.stride(), signed_sin.stride())
    assert slot_mapping.stride(0) == 1 and cache_k.stride() == cache_v.stride()
    return _attention(qkv, num_heads, qkv.stride(0), head_dim, (cos, signed_sin, slot_mapping), cache_k,
                      cache_v, ctx_lens, block_tables, query_len, scale, sliding_window)


def _attention(q_src: torch.Tensor, num_heads: int, stride_qt: int, stride_qh: int,
               rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, cache_k: torch.Tensor,
               cache_v: torch.Tensor, ctx_lens: torch.Tensor, block_tables: torch.Tensor, query_len: int,
               scale: float, sliding_window: int | None) -> torch.Tensor:
    """Both entry points: q_src is q (rope None) or qkv (rope: cos, signed_sin, slot_mapping)."""
    rows = q_src.shape[0]
    num_blocks, block_size, num_kv_heads, head_dim = cache_k.shape
    batch = ctx_lens.shape[0]
    group = num_heads // num_kv_heads
    assert rows == batch * query_len and block_tables.stride(1) == 1, (q_src.shape, block_tables.shape)
    tile_rows = max(16, triton.next_power_of_2(group * query_len))
    block_n = min(64, block_size) if block_size >= 16 else 16
    assert block_size % block_n == 0, f"block_size {block_size}: a multiple of {block_n} expected"
    width = block_tables.shape[1] * block_size
    splits = num_splits(batch, num_kv_heads, width, block_n)
    tiles_per_split = -(-(-(-width // block_n)) // splits)
    device = q_src.device
    acc = torch.empty((batch, num_kv_heads, splits, tile_rows, head_dim), dtype=torch.float32, device=device)
    ml = torch.empty((batch, num_kv_heads, splits, tile_rows, 2), dtype=torch.float32, device=device)
    out = torch.empty((rows, num_heads, head_dim), dtype=q_src.dtype, device=device)
    cos, sin, slots = rope if rope is not None else (q_src, q_src, ctx_lens)  # unread without ROPE
    pdl = use_pdl(q_src)
    _partials_kernel[(batch, num_kv_heads, splits)](
        q_src, cache_k, cache_v, block_tables, ctx_lens, acc, ml, cos, sin, slots,
        stride_qt, stride_qh, cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        block_tables.stride(0), cos.stride(0),
        scale, sliding_window or 0, tiles_per_split,
        QLEN=query_len, GROUP=group, ROWS=tile_rows, D=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, ROPE=rope is not None,
        num_warps=4, num_stages=2, **launch_options(pdl))
    _combine_kernel[(batch, num_kv_heads, group * query_len)](
        acc, ml, out, out.stride(0), out.stride(1),
        QLEN=query_len, GROUP=group, ROWS=tile_rows, D=head_dim, SPLITS=splits, num_warps=1,
        **launch_options(pdl))
    return out
