"""Shared fixtures: the tiny checkpoints `specd make-tiny-models` writes, made once per run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """The workplace's shared/ folder: beside the checkout (as in CI), or SPECD_SHARED_DIR."""
    for candidate in (os.environ.get("SPECD_SHARED_DIR"), REPO.parent / "shared", "/work/shared"):
        if candidate and (Path(candidate) / "data" / "jsonschemabench").is_dir():
            return Path(candidate)
    raise FileNotFoundError("shared/data/jsonschemabench not found beside the checkout; set SPECD_SHARED_DIR")


JSONSCHEMABENCH = shared_dir() / "data" / "jsonschemabench"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of every tiny checkpoint (SPECD_TINY_MODELS reuses a prepared folder)."""
    from specd.tiny_models.make import MODEL_NAMES, make_tiny_models

    prepared = os.environ.get("SPECD_TINY_MODELS")
    if prepared and all((Path(prepared) / n / "config.json").exists() for n in MODEL_NAMES):
        return {n: Path(prepared) / n for n in MODEL_NAMES}
    return make_tiny_models(tmp_path_factory.mktemp("tiny-models"), seed=0)
