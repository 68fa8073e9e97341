"""Shared fixtures: the tiny checkpoints `specd make-tiny-models` writes, made once per run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.shared_data import jsonschemabench_dir

REPO = Path(__file__).resolve().parents[1]


JSONSCHEMABENCH = jsonschemabench_dir()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of every tiny checkpoint (SPECD_TINY_MODELS reuses a prepared folder)."""
    from specd.tiny_models.make import MODEL_NAMES, make_tiny_models

    prepared = os.environ.get("SPECD_TINY_MODELS")
    if prepared and all((Path(prepared) / n / "config.json").exists() for n in MODEL_NAMES):
        return {n: Path(prepared) / n for n in MODEL_NAMES}
    return make_tiny_models(tmp_path_factory.mktemp("tiny-models"), seed=0)
