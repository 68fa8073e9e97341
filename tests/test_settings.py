"""The settings registry (specd/settings.py) is the one list of SPECD_* variables."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from specd import settings

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"SPECD_[A-Z0-9_]+")


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split() if not p.endswith(".md") and (ROOT / p).is_file()]


def test_every_name_in_the_repository_is_registered():
    registry = settings.registered()
    unregistered = {}
    for path in tracked_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for name in set(NAME.findall(text)) - set(registry):
            unregistered.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unregistered, f"register these in specd/settings.py: {unregistered}"


def test_every_setting_is_read_where_the_registry_says():
    for s in settings.registered().values():
        for reader in s.readers:
            text = (ROOT / reader).read_text()
            constant = s.name.removeprefix("SPECD_")
            uses = s.name in text or (reader.endswith(".py") and re.search(rf"\bsettings\.{constant}\b", text))
            assert uses, f"{reader} does not read {s.name}"


def test_services_read_specd_variables_only_through_the_registry():
    literal = re.compile(r"""["']SPECD_[A-Z0-9_]+["']""")
    offenders = [str(p.relative_to(ROOT)) for top in ("specd", "services") for p in (ROOT / top).rglob("*.py")
                 if p.name != "settings.py" and literal.search(p.read_text())]
    assert not offenders, f"read these through specd.settings: {offenders}"


def test_values_are_parsed_and_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("SPECD_DRAFT_AHEAD", "0")
    assert settings.DRAFT_AHEAD.get() is False
    monkeypatch.setenv("SPECD_DRAFT_AHEAD", "")
    assert settings.DRAFT_AHEAD.get() is True
    monkeypatch.setenv("SPECD_PDL", "0")
    assert settings.PDL.get() == "off"
    monkeypatch.setenv("SPECD_KERNELS", "fast")
    with pytest.raises(ValueError, match="^SPECD_KERNELS='fast': expected one of auto, off"):
        settings.KERNELS.get()
    monkeypatch.setenv("SPECD_DRAFT_CARRY", "-2")
    with pytest.raises(ValueError, match="^SPECD_DRAFT_CARRY="):
        settings.DRAFT_CARRY.get()


def test_docs_table_is_current():
    generated = subprocess.run([sys.executable, "-m", "specd.settings"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout
    assert (ROOT / "docs" / "settings.md").read_text() == generated, \
        "regenerate: python -m specd.settings > docs/settings.md"
