"""The step bench's other columns of one runner: the same graphs captured again, and under another
launch setting (no PDL), and what each computes against the default (bench/step.py)."""

from __future__ import annotations

import torch

from bench.step_timing import step_logits, time_specd
from specd.models.llama_runner import LlamaRunner


class runner_setting:
    """Context manager: runner.<attr> = value with its graphs dropped and captured again under it,
    then restored (and dropped again): two columns of one runner differ in nothing else, and no
    second KV cache takes the memory another runner would."""

    def __init__(self, runner: LlamaRunner, attr: str, value) -> None:
        self.runner, self.attr, self.value = runner, attr, value

    def __enter__(self) -> LlamaRunner:
        self.saved = getattr(self.runner, self.attr)
        setattr(self.runner, self.attr, self.value)
        self.runner.static.drop_graphs()
        return self.runner

    def __exit__(self, *exc) -> None:
        setattr(self.runner, self.attr, self.saved)
        self.runner.static.drop_graphs()


def time_recaptured(runner: LlamaRunner, batch: int, q: int, context: int, warmup: int, iters: int,
                    captures: int) -> list[float]:
    """The runner's graphs timed `captures` times, dropped and captured again before each but the
    first: one capture's time moved by 1.5% (up to 3.4%) from capture to capture of the very same
    graphs on the H200 (BENCHMARKS.md, "Verify step (GPU)"), more than some settings under test."""
    out = []
    for i in range(captures):
        if i:
            runner.static.drop_graphs()
        out.append(time_specd(runner, batch, q, context, warmup, iters))
    return out


def time_without_pdl(runner: LlamaRunner, batch: int, q: int, context: int, warmup: int, iters: int) -> float:
    """The same runner with its kernels launched without PDL (kernels/pdl.py)."""
    with runner_setting(runner, "pdl", "off"):
        return time_specd(runner, batch, q, context, warmup, iters)


def check_step_outputs(graphs: LlamaRunner, torch_ops: LlamaRunner, context: int, shapes) -> list[dict]:
    """What the timed columns compute, compared on the same cached keys and values (step_logits
    fills them per sequence, whatever blocks it holds): the kernels with PDL against the same graphs without it
    (a missing wait would be a race: must be bit-identical), staged before its token ids are
    known (the same graph: bit-identical) and against the PyTorch-ops twin (bf16 rounding: relative error ~1e-2)."""
    out = []
    for batch, q in shapes:
        with_pdl = step_logits(graphs, batch, q, context)
        staged = step_logits(graphs, batch, q, context, staged=True)
        with runner_setting(graphs, "pdl", "off"):
            without = step_logits(graphs, batch, q, context)
        twin = step_logits(torch_ops, batch, q, context).double()
        rel = ((with_pdl.double() - twin).norm() / twin.norm()).item()
        out.append({"batch": batch, "q": q, "pdl_vs_no_pdl_max_abs": (with_pdl - without).abs().max().item(),
                    "staged_vs_unstaged_max_abs": (staged - with_pdl).abs().max().item(),
                    "kernels_vs_torch_ops_rel_err": rel, "finite": bool(torch.isfinite(with_pdl).all())})
        print(f"check batch {batch} q {q}: {out[-1]}", flush=True)
    return out
