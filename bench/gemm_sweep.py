"""Block-shape sweep of the skinny GEMM on streaming (not L2-resident) weights, with two variants
the production kernel does not have yet: split-K (fp32 partials, reduced by whoever consumes
them) and a SwiGLU prologue (x = silu(gate) * up computed while loading, for down_proj).

Why: Triton's autotuner times a config by re-running it on one weight, which for o_proj (32 MB)
sits in the 60 MB L2, so it picks block shapes for cached data; a verify step streams every weight
from HBM once. Each timing here is a CUDA graph of back-to-back products over rotating copies of
the weight (bench/gemm.py's method).

    python -m bench gemm-sweep --out results/      # CUDA only, ~1-2 min
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from bench.gemm import MIN_BYTES_PER_SET, SHAPES_8B, _graph_time_us

try:
    import triton
    import triton.language as tl
except Exception:
    triton = None

if triton is not None:
    @triton.jit
    def _sweep_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      M_BUCKET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, ACT: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, M_BUCKET)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        k_len = K // SPLIT_K
        ks = split * k_len + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
        w_ptrs = w_ptr + cols[:, None] * stride_wn + ks[None, :]
        row_ok = rows[:, None] < M
        col_ok = cols[:, None] < N
        acc = tl.zeros((M_BUCKET, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k_len, BLOCK_K):
            if ACT:  # x = silu(gate) * up, gate at column k, up at column K + k of a [M, 2K] input
                gate = tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32)
                up = tl.load(x_ptrs + K, mask=row_ok, other=0.0).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(w_ptr.dtype.element_ty).to(tl.float32)
                x = (act * up).to(w_ptr.dtype.element_ty)
            else:
                x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            w = tl.load(w_ptrs, mask=col_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w))
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = y_ptr + split * M * N + rows[:, None] * stride_ym + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < N))


def _launch(x, w, y, m, n, k, block_n, block_k, warps, stages, split_k, act):
    grid = (triton.cdiv(n, block_n), split_k)
    _sweep_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), n, M_BUCKET=16 if m <= 16 else 32,
                        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, ACT=act,
                        num_warps=warps, num_stages=stages)


def run_gemm_sweep(rows=(4,), bandwidth_tbs: float = 4.8) -> list[dict]:
    assert torch.cuda.is_available()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    configs = list(itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 5)))
    results = []
    for name, n, k in SHAPES_8B:
        nbytes = n * k * 2
        copies = max(2, -(-MIN_BYTES_PER_SET // nbytes))
        weights = [torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * 0.02 for _ in range(copies)]
        for m in rows:
            variants = [(1, False), (2, False), (4, False)] + ([(1, True), (2, True)] if name == "down" else [])
            for split_k, act in variants:
                x = torch.randn(m, 2 * k if act else k, device=dev, dtype=dtype, generator=gen)
                y = torch.empty((split_k, m, n), device=dev,
                                dtype=torch.float32 if split_k > 1 else dtype)
                xs = torch.nn.functional.silu(x[:, :k]) * x[:, k:] if act else x
                ref = (xs.float() @ weights[0].float().T)
                best = None
                for bn, bk, warps, stages in configs:
                    if (k // split_k) % bk:
                        continue
                    try:
                        _launch(x, weights[0], y, m, n, k, bn, bk, warps, stages, split_k, act)
                        got = y.float().sum(0)
                        err = float((got - ref).norm() / ref.norm())
                        if not err < 1e-2:
                            continue

                        def run():
                            for w in weights:
                                _launch(x, w, y, m, n, k, bn, bk, warps, stages, split_k, act)

                        us = _graph_time_us(run, copies, replays=10)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile
                        print(f"skip {name} {bn} {bk} {warps} {stages}: {type(e).__name__}", flush=True)
                        continue
                    if best is None or us < best["us"]:
                        best = {"shape": name, "M": m, "split_k": split_k, "act": act, "us": round(us, 2),
                                "tbs": round(nbytes / (us * 1e-6) / 1e12, 2), "BLOCK_N": bn, "BLOCK_K": bk,
                                "num_warps": warps, "num_stages": stages, "rel_err": err}
                print(json.dumps(best), flush=True)
                results.append(best)
        del weights
        torch.cuda.empty_cache()
    return results


def write_sweep(results: list[dict], out_dir: Path) -> str:
    lines = ["| product | M | split-K | SwiGLU prologue | best us | TB/s | BLOCK_N | BLOCK_K | warps | stages |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r:
            lines.append(f"| {r['shape']} | {r['M']} | {r['split_k']} | {r['act']} | {r['us']} | {r['tbs']} | "
                         f"{r['BLOCK_N']} | {r['BLOCK_K']} | {r['num_warps']} | {r['num_stages']} |")
    table = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gemm_sweep.md").write_text(table)
    (out_dir / "gemm_sweep.json").write_text(json.dumps(results, indent=1))
    return table
