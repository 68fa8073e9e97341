"""Model path resolution: local directories and the local Hugging Face cache only."""

from __future__ import annotations

import pytest

from specd.models.model_path import ModelNotFoundError, resolve_model_path


def test_local_directory(checkpoint):
    path = checkpoint("llama")
    assert resolve_model_path(str(path)) == path.resolve()


def test_missing_model_has_clear_message(tmp_path):
    for name in ("no-such-org/no-such-model", str(tmp_path / "missing"), "bad id!!"):
        with pytest.raises(ModelNotFoundError) as info:
            resolve_model_path(name, cache_dir=tmp_path)
        message = str(info.value)
        assert f"model {name!r} is not a local directory and is not in the local Hugging Face cache" in message
        assert "specd does not download weights" in message
        assert "config.json and *.safetensors" in message
    assert issubclass(ModelNotFoundError, ValueError)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_found_in_local_hub_cache(tmp_path):
    # The hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolve_model_path("org/tiny", cache_dir=tmp_path) == snapshot
