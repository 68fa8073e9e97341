"""Build the proposer a SpeculativeConfig names."""

from __future__ import annotations

from pathlib import Path

import torch

from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.proposers.base import Proposer


def build_proposer(spec: SpeculativeConfig, target_path: Path, target_vocab_size: int,
                   engine_config: PytorchEngineConfig, device: torch.device, dtype: torch.dtype) -> Proposer:
    """Load the drafter; MTP heads default to the target checkpoint when spec.model is empty."""
    from specd.models.model_path import resolve_model_path

    if spec.method == "ngram":
        from specd.proposers.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "replay":  # bench only: drafts a precomputed greedy continuation
        from specd.proposers.replay import ReplayProposer, load_references

        if not spec.replay_references:
            raise ValueError("replay_references: method 'replay' needs a references file (bench only)")
        return ReplayProposer(load_references(spec.replay_references), target_vocab_size,
                              spec.replay_corrupt_rate)
    draft_path = resolve_model_path(spec.model) if spec.model else target_path
    # the heads' CUDA graphs (on CUDA), bucketed up to the batch the drafter serves
    head_options = dict(static_steps=False if engine_config.eager_mode else None,
                        max_batch_size=engine_config.max_batch_size)
    if spec.method == "draft_model":
        from specd.models.loader import load_target_runner
        from specd.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(load_target_runner(draft_path, engine_config), target_vocab_size)
    if spec.method == "eagle3":
        from specd.proposers.eagle3 import Eagle3Proposer

        return Eagle3Proposer(draft_path, target_path, device=device, dtype=dtype, **head_options)
    if spec.method == "deepseek_mtp":
        from specd.proposers.deepseek_mtp import DeepseekMTPProposer

        return DeepseekMTPProposer(draft_path, device=device, dtype=dtype, target_path=target_path,
                                   **head_options)
    if spec.method == "qwen3_5_mtp":
        from specd.proposers.qwen3_5_mtp import Qwen35MTPProposer

        return Qwen35MTPProposer(draft_path, device=device, dtype=dtype, **head_options)
    raise ValueError(f"method: unknown speculative method {spec.method!r}")
