"""Fixtures for the grammar tests: the tiny target's tokenizer, compiler caches, real schemas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import JSONSCHEMABENCH as SCHEMA_ROOT  # noqa: E402
EOS_IDS = [1, 3]  # the tiny checkpoints' eos_token_id (keep in step with the test modules)
VOCAB = 512


@pytest.fixture(scope="session")
def schema_files() -> list[Path]:
    """The 600 jsonschemabench schemas, sorted by folder and name."""
    return sorted(SCHEMA_ROOT.glob("*/*.json"))


@pytest.fixture(scope="session")
def load_schema():
    """name ("Folder/file.json") -> the schema."""
    return lambda name: json.loads((SCHEMA_ROOT / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def tokenizer(tiny_models):
    from specd.models.loader import load_tokenizer

    return load_tokenizer(tiny_models["target-llama"])


@pytest.fixture(scope="session")
def cache(tokenizer):
    """A compiler cache for the tiny target (vocab 512 = the tokenizer's size)."""
    from specd.grammar.compiler import GrammarCompilerCache

    # Mechanics tests use any real schema, also those xgrammar only approximates.
    return GrammarCompilerCache(tokenizer, VOCAB, eos_token_ids=EOS_IDS, reject_inexact=False)


@pytest.fixture(scope="session")
def strict_cache(tokenizer):
    """The serving default: schemas xgrammar cannot enforce exactly are refused."""
    from specd.grammar.compiler import GrammarCompilerCache

    return GrammarCompilerCache(tokenizer, VOCAB, eos_token_ids=EOS_IDS, max_entries=1024)


@pytest.fixture(scope="session")
def token_texts(tokenizer) -> list[str]:
    return [tokenizer.decode([i]) for i in range(VOCAB)]


def _allowed_ids(row: torch.Tensor) -> list[int]:
    return [i for i in range(row.shape[0] * 32) if (int(row[i // 32]) >> (i % 32)) & 1]


@pytest.fixture(scope="session")
def allowed_ids():
    """[W] int32 bitmask row -> the token ids it allows (reference unpacking, bit by bit)."""
    return _allowed_ids
