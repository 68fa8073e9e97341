"""Train the independent draft model: a smaller Llama distilled from the frozen target's outputs.

Matching the target's distribution (not the corpus's one-hot next token) is what acceptance
rewards, so the loss is the soft cross-entropy to the target's next-token probabilities.
"""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from specd.train.data import DrafterBatches
from specd.train.loop import LoopConfig, LoopResult, run_loop
from specd.train.target import autocast
from specd.train.ttt import soft_cross_entropy


def train_draft(draft: LlamaForCausalLM, target: LlamaForCausalLM, batches: DrafterBatches,
                cfg: LoopConfig, device: torch.device, log=print) -> LoopResult:
    draft.train()
    target.eval()

    def loss_fn(step: int) -> torch.Tensor:
        ids = batches.next()
        with torch.no_grad(), autocast(device):
            probs = torch.softmax(target(input_ids=ids).logits.float(), dim=-1)
        with autocast(device):
            logits = draft(input_ids=ids).logits
        valid = torch.ones(ids.shape[1], dtype=torch.bool, device=device)
        return soft_cross_entropy(logits, probs, valid)

    return run_loop(draft.parameters(), loss_fn, cfg, "draft", log)
