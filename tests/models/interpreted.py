"""Run a snippet under Triton's interpreter (TRITON_INTERPRET=1), in a subprocess: the variable
must be set before triton.jit decorates a kernel, i.e. before specd's kernel modules import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# A prelude for scripts: small_step(gemm, kernels) -> (logits, aux features) of one static step of a
# 2-layer float16 model (hidden 128, intermediate 256: o_proj and down_proj split-K in two), two
# sequences of 3 new tokens over 9 and 21 cached ones, through a fresh runner ("auto", "auto": the
# skinny GEMMs and the fused kernels; "torch", "off": PyTorch ops and F.linear).
SMALL_STEP = """
import dataclasses
import torch
from bench.step import arch_config, random_model
from specd.messages import PytorchEngineConfig
from specd.models.base import SequenceChunk
from specd.models.llama_runner import LlamaRunner
small_config = dataclasses.replace(arch_config("small"), hidden_size=128, intermediate_size=256, head_dim=32)
small_model = random_model(small_config, torch.float16, torch.device("cpu"))

def small_step(gemm, kernels):
    ec = PytorchEngineConfig(max_batch_size=2, block_size=16, num_gpu_blocks=16, session_len=64,
                             device_type="cpu", dtype="float16")
    r = LlamaRunner(".", ec, model=small_model, config=small_config, use_static_path=True,
                    gemm=gemm, kernels=kernels)
    r.set_aux_hidden_layers([0, 1])
    for s, ctx in [(0, 9), (1, 21)]:
        r.add_sequence(s)
        r.kv_cache.append_slots(s, ctx)
    step = r.forward([SequenceChunk(0, [1, 2, 3]), SequenceChunk(1, [4, 5, 6])], want_aux_hidden=True)
    return step.logits, step.aux_hidden_states
"""


def run_interpreted(code: str, timeout: int = 600, prelude: str = "") -> str:
    """Run code (after prelude, e.g. SMALL_STEP) in a subprocess under Triton's interpreter; its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    script = textwrap.dedent(prelude) + "\n" + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
