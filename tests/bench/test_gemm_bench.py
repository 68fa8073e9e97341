"""bench/gemm.py's split-K rows on CPU: the timing code's products and checks run through Triton's
interpreter (float16), with the CUDA-graph timer replaced by one call, and the table shows them."""

from __future__ import annotations

import json

import pytest

from specd.models import skinny_gemm
from tests.models.interpreted import run_interpreted

pytestmark = pytest.mark.skipif(skinny_gemm.triton is None, reason="triton (xgrammar pulls it)")


def test_split_k_rows_time_partials_and_norms_and_reach_the_table():
    out = run_interpreted("""
        import json, tempfile
        from pathlib import Path
        import torch
        import bench.gemm as gemm
        calls = []
        def once(fn, copies, replays=20):  # no CUDA graphs here: run the products once
            calls.append(fn.__name__)
            fn()
            return 1.5 * len(calls)
        gemm._graph_time_us = once
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 256, generator=g).half()
        weights = [(torch.randn(64, 256, generator=g) * 0.05).half() for _ in range(2)]
        ref = x.float() @ weights[0].float().T
        row = gemm._split_k_timings(x, weights, 2, ref, copies=2)
        assert calls == ["split", "kernel_norm", "split_norm"], calls
        assert row["split_k"] == 2 and row["splitk_rel_err"] < 1e-5, row
        assert (row["splitk_us"], row["kernel_norm_us"], row["splitk_norm_us"]) == (1.5, 3.0, 4.5), row
        base = {"shape": "o", "N": 64, "K": 256, "M": 4, "weight_mb": 0.0, "floor_us": 0.01,
                "cublas_us": 2.0, "cublas_tbs": 1.0, "kernel_us": 2.5, "kernel_tbs": 0.8, "kernel_rel_err": 1e-3}
        table = gemm.write_gemm_results([dict(base, **row), dict(base, shape="qkv")], Path(tempfile.mkdtemp()))
        print(json.dumps(table))
    """)
    table = json.loads(out.strip().splitlines()[-1])
    # kernel, split-K, kernel + norm, split-K + norm, saved (kernel + norm minus split-K + norm)
    split_lines = [line for line in table.splitlines() if line.startswith("| o | 4 | 2 |")]
    assert len(split_lines) == 1 and split_lines[0].startswith("| o | 4 | 2 | 2.5 | 1.5 | 3.0 | 4.5 | -1.50 | ")
    assert "split-K + norm us" in table and "| qkv | 4 |" in table and "| qkv | 4 | 2 |" not in table
