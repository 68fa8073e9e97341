"""Assemble a SpecEngine from a checkpoint path and the user's configs (pipeline, verifier, tests)."""

from __future__ import annotations

from pathlib import Path

from specd.engine.engine import SpecEngine
from specd.messages import PytorchEngineConfig, SpeculativeConfig


def build_engine(model_path: str | Path, backend_config: PytorchEngineConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, tokenizer=None,
                 proposer=None, grammar_backend=None) -> SpecEngine:
    """Load the target runner and the drafter the configs name (or use the given proposer)."""
    from specd.models.loader import load_target_runner
    from specd.models.model_path import resolve_model_path
    from specd.proposers.factory import build_proposer

    config = backend_config or PytorchEngineConfig()
    path = resolve_model_path(str(model_path))
    runner = load_target_runner(path, config)
    k, adaptive = 0, True
    if speculative_config is not None and speculative_config.num_speculative_tokens > 0:
        if proposer is None:
            proposer = build_proposer(speculative_config, path, runner.info.vocab_size, config,
                                      runner.device, runner.dtype)
        k, adaptive = speculative_config.num_speculative_tokens, speculative_config.adaptive
    elif proposer is not None:
        raise ValueError("proposer: given without a speculative_config naming num_speculative_tokens")
    aux_layers = getattr(proposer, "aux_layer_ids", None)  # EAGLE-3 picks its target layers
    if aux_layers:
        runner.set_aux_hidden_layers(list(aux_layers))
    max_len = config.session_len or runner.info.max_position_embeddings
    return SpecEngine(runner, proposer, k, max_batch_size=config.max_batch_size, max_model_len=max_len,
                      tokenizer=tokenizer, max_prefill_tokens=config.max_prefill_token_num,
                      grammar_backend=grammar_backend, adaptive=adaptive)
