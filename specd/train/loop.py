"""One optimisation loop for every stage: AdamW, warmup then cosine decay, a wall-clock budget.

The schedule runs on progress = max(step / steps, elapsed / time_budget), so a stage given a time
budget still decays its learning rate to the end and stops on time on slower hardware; with
enough time it is plain step-based (and reproducible).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch


@dataclass
class LoopConfig:
    steps: int
    lr: float
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    time_budget_s: float | None = None
    log_every: int = 50

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: must be >= 1, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s: must be > 0, got {self.time_budget_s}")


@dataclass
class LoopResult:
    steps: int
    seconds: float
    first_loss: float  # mean over the first logging window
    last_loss: float  # mean over the last logging window
    history: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"steps": self.steps, "seconds": round(self.seconds, 1),
                "first_loss": round(self.first_loss, 4), "last_loss": round(self.last_loss, 4)}


def lr_factor(step: int, progress: float, warmup_steps: int) -> float:
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    return warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def run_loop(params: Iterable[torch.nn.Parameter], loss_fn: Callable[[int], torch.Tensor],
             cfg: LoopConfig, name: str, log: Callable[[str], None] = print) -> LoopResult:
    """Minimise loss_fn(step) over `params`; returns first/last window losses for the record."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]  # norms: no weight decay
    fused = all(p.is_cuda for p in params)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=fused or None)
    start = time.monotonic()
    window: list[torch.Tensor] = []
    history: list[tuple[int, float]] = []
    step = 0
    while step < cfg.steps:
        elapsed = time.monotonic() - start
        progress = step / cfg.steps
        if cfg.time_budget_s:
            progress = max(progress, elapsed / cfg.time_budget_s)
            if progress >= 1.0:
                break
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(step, progress, cfg.warmup_steps)
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        window.append(loss.detach())
        step += 1
        if len(window) == cfg.log_every or step == cfg.steps:
            mean = float(torch.stack(window).float().mean())  # one sync per window
            history.append((step, mean))
            window = []
            log(f"[{name}] step {step}/{cfg.steps} loss {mean:.4f} "
                f"({time.monotonic() - start:.0f}s)")
    if window:
        history.append((step, float(torch.stack(window).float().mean())))
    if not history:
        raise RuntimeError(f"[{name}] the time budget ran out before the first step")
    return LoopResult(steps=step, seconds=time.monotonic() - start, first_loss=history[0][1],
                      last_loss=history[-1][1], history=history)
