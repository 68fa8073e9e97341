"""The verify step's GEMMs on their own: cuBLAS (F.linear) vs the skinny Triton kernel, per weight
shape of an 8B Llama and per row count, against the weight-read floor.

Each weight matrix is read once per product (its bytes dominate: x and y are a few rows), so the
figure of merit is achieved bandwidth = weight bytes / time. The products run back to back inside
one captured CUDA graph (as in a verify step, without launch gaps), over enough copies of each
weight that they never sit in the 60 MB L2 (a step reads 16 GB once). Every kernel output is
checked against float32 F.linear first.

o_proj and down_proj also run as the step runs them (fused_forward.py): where split_k_for(N, K)
says so, the skinny kernel split-K into fp32 partials [S, M, N]. Those partials are no product
until the next RMSNorm sums them, so both ways are also timed with that norm after each product
(`kernel_norm_us`: the kernel, then rms_norm over its [M, N]; `splitk_norm_us`: the partials, then
rms_norm summing them), which is the step's cost of each choice.

    python -m bench gemm --out results/       # CUDA only
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from specd.models import skinny_gemm
from specd.models.kernels import norm_act

# (name, N, K) of an 8B Llama's products: fused qkv, o_proj, fused gate/up, down_proj, lm_head.
SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
             ("lm_head", 128256, 4096)]
INTO_NORM = ("o", "down")  # products whose output the step's next RMSNorm adds (the split-K path)
ROWS = (1, 4, 8, 16, 32)
MIN_BYTES_PER_SET = 512 * 2 ** 20  # weights cycled per measurement: ~8x the L2


def _graph_time_us(fn, copies: int, replays: int = 20) -> float:
    """Median microseconds per product: `copies` products captured in one graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # warm-up: autotuning, cuBLAS handles, workspaces
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    times.sort()
    return times[len(times) // 2]


def run_gemm_bench(shapes=SHAPES_8B, rows=ROWS, bandwidth_tbs: float = 4.8) -> list[dict]:
    assert torch.cuda.is_available(), "the GEMM bench measures CUDA kernels"
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    for name, n, k in shapes:
        nbytes = n * k * 2
        copies = max(2, -(-MIN_BYTES_PER_SET // nbytes))
        weights = [torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
            row = {"shape": name, "N": n, "K": k, "M": m, "weight_mb": round(nbytes / 2 ** 20, 1),
                   "floor_us": round(nbytes / (bandwidth_tbs * 1e12) * 1e6, 2)}
            ref = F.linear(x.float(), weights[0].float())
            out_torch = torch.empty(m, n, device=dev, dtype=dtype)

            def cublas():
                for w in weights:
                    torch.matmul(x, w.T, out=out_torch)

            row["cublas_us"] = round(_graph_time_us(cublas, copies), 2)
            if skinny_gemm.kernel_applies(x, weights[0]):
                y = skinny_gemm.skinny_gemm(x, weights[0])
                row["kernel_rel_err"] = float((y.float() - ref).norm() / ref.norm())

                def kernel():
                    for w in weights:
                        skinny_gemm.skinny_gemm(x, w)

                row["kernel_us"] = round(_graph_time_us(kernel, copies), 2)
                best = skinny_gemm._skinny_gemm_kernel.best_config
                row["kernel_config"] = str(best)
                splits = skinny_gemm.split_k_for(n, k)
                if name in INTO_NORM and splits > 1:
                    row.update(_split_k_timings(x, weights, splits, ref, copies))
            row["cublas_rel_err"] = float((F.linear(x, weights[0]).float() - ref).norm() / ref.norm())
            for key in ("cublas_us", "kernel_us"):
                if key in row:
                    row[key.replace("_us", "_tbs")] = round(nbytes / (row[key] * 1e-6) / 1e12, 2)
            print(json.dumps(row), flush=True)
            results.append(row)
        del weights
        torch.cuda.empty_cache()
    return results


def _split_k_timings(x: torch.Tensor, weights: list[torch.Tensor], splits: int, ref: torch.Tensor,
                     copies: int) -> dict:
    """The production split-K path of a product that feeds an RMSNorm: the partials alone, and
    kernel + norm vs partials + norm (the norm's residual and gain are [M, N] and [N])."""
    m, n = x.shape[0], weights[0].shape[0]
    partials = skinny_gemm.skinny_gemm_partials(x, weights[0], splits)
    out = {"split_k": splits, "splitk_config": str(skinny_gemm._skinny_gemm_kernel.best_config),
           "splitk_rel_err": float((partials.sum(0) - ref).norm() / ref.norm())}
    residual = torch.randn(m, n, device=x.device, dtype=x.dtype)
    gain = torch.ones(n, device=x.device, dtype=x.dtype)
    _, normed = norm_act.rms_norm(residual, gain, 1e-5, partials)
    in_order = sum(partials[1:], partials[0])  # ((p0 + p1) + p2) ..., the norm's order
    _, normed_ref = norm_act.rms_norm(residual, gain, 1e-5, in_order.to(x.dtype))
    assert torch.equal(normed, normed_ref), "the norm's sum of the partials is not the unsplit delta's"

    def split():
        for w in weights:
            skinny_gemm.skinny_gemm_partials(x, w, splits)

    def kernel_norm():
        for w in weights:
            norm_act.rms_norm(residual, gain, 1e-5, skinny_gemm.skinny_gemm(x, w))

    def split_norm():
        for w in weights:
            norm_act.rms_norm(residual, gain, 1e-5, skinny_gemm.skinny_gemm_partials(x, w, splits))

    out["splitk_us"] = round(_graph_time_us(split, copies), 2)
    out["kernel_norm_us"] = round(_graph_time_us(kernel_norm, copies), 2)
    out["splitk_norm_us"] = round(_graph_time_us(split_norm, copies), 2)
    return out


def write_gemm_results(results: list[dict], out_dir: Path) -> str:
    lines = ["| product | M | weight MB | floor us | cuBLAS us | cuBLAS TB/s | kernel us | kernel TB/s "
             "| kernel / cuBLAS | kernel rel err |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        k = r.get("kernel_us")
        lines.append(f"| {r['shape']} | {r['M']} | {r['weight_mb']} | {r['floor_us']} | {r['cublas_us']} | "
                     f"{r['cublas_tbs']} | {k if k is not None else '-'} | {r.get('kernel_tbs', '-')} | "
                     f"{(r['cublas_us'] / k):.2f}x | {r.get('kernel_rel_err', float('nan')):.1e} |"
                     if k is not None else
                     f"| {r['shape']} | {r['M']} | {r['weight_mb']} | {r['floor_us']} | {r['cublas_us']} | "
                     f"{r['cublas_tbs']} | - | - | - | - |")
    split_rows = [r for r in results if "splitk_us" in r]
    if split_rows:  # the step's path for o/down: split-K partials summed by the next RMSNorm
        lines += ["", "| product | M | split-K | kernel us | split-K us | kernel + norm us "
                  "| split-K + norm us | saved per product us | split-K rel err |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in split_rows:
            lines.append(f"| {r['shape']} | {r['M']} | {r['split_k']} | {r['kernel_us']} | "
                         f"{r['splitk_us']} | {r['kernel_norm_us']} | {r['splitk_norm_us']} | "
                         f"{r['kernel_norm_us'] - r['splitk_norm_us']:.2f} | {r['splitk_rel_err']:.1e} |")
    table = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gemm.md").write_text(table)
    (out_dir / "gemm.json").write_text(json.dumps(results, indent=1))
    return table
