"""Where the workplace's shared/ data is: beside the checkout (as CI lays it out), or
SPECD_SHARED_DIR, or /work/shared (a clone elsewhere on the development machine)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    for candidate in (os.environ.get("SPECD_SHARED_DIR"), ROOT.parent / "shared", "/work/shared"):
        if candidate and (Path(candidate) / "data" / "jsonschemabench").is_dir():
            return Path(candidate)
    raise FileNotFoundError("shared/data/jsonschemabench not found beside the checkout; set SPECD_SHARED_DIR")


def jsonschemabench_dir() -> Path:
    """The 600 real JSON schemas (FOLDER/FILE.json)."""
    return shared_dir() / "data" / "jsonschemabench"
