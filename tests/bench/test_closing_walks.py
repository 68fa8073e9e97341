"""bench/closing_walks.py: closing walks from random states of real schemas, on the vocabulary where
a walk once found no suffix (Github_easy/o83161 on the tiny Qwen3.5 target's byte-level tokens)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_random_state_has_a_closing_suffix(tiny_models):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "closing_walks.py"),
                          "--target", str(tiny_models["target-qwen3_5-mtp"]), "--lengths", "0", "20", "60",
                          "--schemas", "Github_easy/o83161", "Github_easy/o10298", "Glaiveai2K/calculate_area_092f0b0f"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 compiled schemas, 9 walks, 0 found no suffix within 128 tokens" in out.stdout, out.stdout
    assert "suffix tokens: median" in out.stdout
