"""Where a verify step's device time goes: kernels of one static-path forward of the 8B shape,
grouped by name, from torch.profiler (CUDA activity).

The static path runs without capture here (same kernels as the graph replays, launched one by
one), so each kernel is recorded by itself; the device time per kernel is what a replay spends in
it, and their sum against the replayed step's wall time says how much is gaps between kernels.

    python -m bench profile --out results/        # CUDA only
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.step import arch_config, random_model
from bench.step_timing import repeatable_step
from specd.messages import PytorchEngineConfig
from specd.models.llama_runner import LlamaRunner


def profile_forward(runner: LlamaRunner, batch: int, q: int, context: int, repeats: int = 5) -> dict:
    with repeatable_step(runner, batch, q, context) as step:
        for _ in range(3):
            step()  # warm-up: autotuning, workspaces
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                step()
            torch.cuda.synchronize()
    kernels = []
    for ev in prof.key_averages():
        device_us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if device_us <= 0 or ev.count == 0:
            continue
        kernels.append({"name": ev.key[:120], "per_forward": ev.count / repeats,
                        "us_per_forward": device_us / repeats})
    kernels.sort(key=lambda k: -k["us_per_forward"])
    total = sum(k["us_per_forward"] for k in kernels)
    launches = sum(k["per_forward"] for k in kernels)
    return {"batch": batch, "q": q, "device_us_per_forward": round(total, 1),
            "kernels_per_forward": launches, "top": kernels[:25]}


VARIANTS = {"kernels": dict(gemm="auto", kernels="auto"), "torch-ops": dict(gemm="torch", kernels="off")}


def run_profile(cases=((1, 4), (64, 4)), context: int = 1024, variants=tuple(VARIANTS)) -> list[dict]:
    assert torch.cuda.is_available(), "the profile reads CUDA kernels"
    dev = torch.device("cuda")
    config = arch_config("8b")
    model = random_model(config, torch.bfloat16, dev)
    batch_max = max(b for b, _ in cases)
    blocks = batch_max * -(-(context + 16) // 64)
    ec = PytorchEngineConfig(max_batch_size=batch_max, block_size=64, num_gpu_blocks=blocks,
                             session_len=context + 16, device_type="cuda", dtype="bfloat16", eager_mode=True)
    out = []
    for name in variants:
        runner = LlamaRunner(".", ec, model=model, config=config, use_static_path=True,
                             **VARIANTS[name])
        for batch, q in cases:
            result = profile_forward(runner, batch, q, context) | {"variant": name}
            print(json.dumps({k: v for k, v in result.items() if k != "top"}), flush=True)
            for k in result["top"][:12]:
                print(f"  {k['us_per_forward']:9.1f} us  x{k['per_forward']:6.0f}  {k['name']}", flush=True)
            out.append(result)
        del runner
        torch.cuda.empty_cache()
    return out


def write_profile(results: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "profile.json").write_text(json.dumps(results, indent=1))
