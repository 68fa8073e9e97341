"""Choosing and building the target runner (and tokenizer) for a checkpoint.

runner="auto" takes our LlamaRunner for the Llama family (Llama, Qwen2, Qwen3, Mistral) when
hf_config.py accepts the checkpoint, and transformers' generic HFRunner otherwise (DeepSeek-V3,
Qwen3.5, an unsupported RoPE type, ...). runner="llama" / "hf" force one.
"""

from __future__ import annotations

import logging
from pathlib import Path

from specd.messages import PytorchEngineConfig
from specd.models.base import TargetRunner
from specd.models.hf_config import (LLAMA_FAMILY_ARCHITECTURES, LlamaArchConfig,
                                    UnsupportedArchitectureError, read_json)
from specd.models.model_path import resolve_model_path

logger = logging.getLogger(__name__)


def read_architectures(model_dir: str | Path) -> list[str]:
    """`architectures` of config.json (empty when absent)."""
    return list(read_json(Path(model_dir) / "config.json").get("architectures") or [])


def choose_runner(model_dir: str | Path, runner: str = "auto") -> str:
    """"llama" or "hf" for this checkpoint."""
    if runner in ("llama", "hf"):
        return runner
    if runner != "auto":
        raise ValueError(f"runner: expected auto, llama or hf, got {runner!r}")
    architectures = read_architectures(model_dir)
    if not architectures or architectures[0] not in LLAMA_FAMILY_ARCHITECTURES:
        return "hf"
    try:
        LlamaArchConfig.from_model_dir(model_dir)
    except UnsupportedArchitectureError as e:
        logger.info("%s: using the transformers runner (%s)", model_dir, e)
        return "hf"
    return "llama"


def load_target_runner(model_path: str | Path,
                       engine_config: PytorchEngineConfig | None = None) -> TargetRunner:
    """Resolve the checkpoint locally (never downloads) and build its runner."""
    engine_config = engine_config or PytorchEngineConfig()
    model_dir = resolve_model_path(model_path, cache_dir=engine_config.download_dir,
                                   revision=engine_config.revision)
    kind = choose_runner(model_dir, engine_config.runner)
    if kind == "llama":
        from specd.models.llama_runner import LlamaRunner
        return LlamaRunner(model_dir, engine_config)
    from specd.models.hf_runner import HFRunner
    return HFRunner(model_dir, engine_config)


def load_tokenizer(model_path: str | Path, **kwargs):
    """The checkpoint's tokenizer through transformers.AutoTokenizer (local files only)."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_path(model_path)
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True, **kwargs)
