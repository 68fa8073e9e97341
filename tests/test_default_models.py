"""The trained default family ships with specd and installs into an empty models folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specd import settings
from specd.cli import main
from specd.default_models import default_models_dir, install_default_models

ENV_VAR = settings.DEFAULT_MODELS.name
from specd.train.family import NAMES


def test_install_copies_the_family_once(tmp_path, capsys):
    dest = tmp_path / "models"
    assert main(["install-default-models", str(dest)]) == 0
    for name in NAMES.values():
        assert (dest / name / "config.json").is_file()
        assert (dest / name / "model.safetensors").is_file()
    (dest / NAMES["target"] / "marker").write_text("kept")
    assert install_default_models(dest) == []  # already there: nothing overwritten
    assert (dest / NAMES["target"] / "marker").read_text() == "kept"


def test_the_shipped_family_is_the_recorded_training_run():
    src = default_models_dir()
    record = json.loads((src / "TRAINING.json").read_text())
    target = json.loads((src / NAMES["target"] / "config.json").read_text())
    assert target["num_hidden_layers"] == record["budget"]["target_shape"]["num_layers"]
    total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert total < 40 * 2**20  # the budget for weights kept in the repository


def test_a_missing_family_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nowhere"))
    monkeypatch.setattr("specd.default_models.CANDIDATES", ())
    with pytest.raises(FileNotFoundError, match=ENV_VAR):
        default_models_dir()


def test_the_source_flag_comes_before_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nowhere"))
    shipped = Path(__file__).resolve().parents[1] / "models"
    assert main(["install-default-models", str(tmp_path / "dest"), "--source", str(shipped)]) == 0
    assert (tmp_path / "dest" / NAMES["target"] / "config.json").is_file()
    monkeypatch.setattr("specd.default_models.CANDIDATES", ())
    with pytest.raises(FileNotFoundError, match="pass --source"):
        default_models_dir(tmp_path / "empty")
