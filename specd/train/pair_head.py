"""Training loop of a pair head (EAGLE-3 or MTP) on a frozen target, with the training-time test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specd.train.data import DrafterBatches
from specd.train.features import TargetFeatures, target_features
from specd.train.loop import LoopConfig, LoopResult, run_loop
from specd.train.target import autocast
from specd.train.ttt import ttt_losses


@dataclass
class PairHeadTask:
    """How one head reads the target: its first hidden rows, its logits and its label space."""

    head: nn.Module
    first_hidden: Callable[[TargetFeatures], torch.Tensor]  # -> [B, T, H]
    logits: Callable[[torch.Tensor], torch.Tensor]  # [B, N, H] -> [B, N, V']
    label_probs: Callable[[TargetFeatures], torch.Tensor]  # -> [B, T, V'] target distribution
    num_steps: int = 4  # draft steps trained (k = 3 uses 3)
    step_decay: float = 0.8  # EAGLE-3's weight of step j: decay ** j

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps: must be >= 1, got {self.num_steps}")


def train_pair_head(task: PairHeadTask, target: nn.Module, aux_layer_ids: list[int],
                    batches: DrafterBatches, cfg: LoopConfig, device: torch.device, name: str,
                    log=print) -> tuple[LoopResult, list[float]]:
    """Returns the loop's result and the last window's per-step top-1 agreement with the target."""
    task.head.train()
    last_agreement: list[torch.Tensor] = []

    def loss_fn(step: int) -> torch.Tensor:
        ids = batches.next()
        feats = target_features(target, ids, aux_layer_ids)
        with autocast(device):
            losses, agreement = ttt_losses(task.head, task.logits, ids, task.first_hidden(feats),
                                           task.label_probs(feats), task.num_steps)
        last_agreement[:] = [a.detach() for a in agreement]
        if step % cfg.log_every == 0:
            log(f"[{name}] step {step} top-1 agreement per draft step: "
                + " ".join(f"{float(a):.3f}" for a in agreement))
        return sum(task.step_decay ** j * loss for j, loss in enumerate(losses))

    result = run_loop(task.head.parameters(), loss_fn, cfg, name, log)
    return result, [round(float(a), 4) for a in last_agreement]
