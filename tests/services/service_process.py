"""A specd service as a real process for CLI tests: started with `python -m specd.cli ...`, its
output collected, and SIGTERM at the end, which it must answer by exiting 0."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def heavy_imports_of(module: str, heavy: set[str]) -> list[str]:
    """Which of `heavy` a fresh interpreter has loaded after importing module (a CLI's parser
    should load none: `--help` and flag errors answer at once)."""
    out = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(','.join(sorted({heavy!r} & "
                          "set(sys.modules))))"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [name for name in out.stdout.strip().split(",") if name]


@contextlib.contextmanager
def serving(args: list[str]) -> Iterator[list[str]]:
    """Runs `specd <args>` for the body; yields its output lines so far (complete after the block).
    Leaving the block without an error sends SIGTERM and asserts a clean exit."""
    proc = subprocess.Popen([sys.executable, "-m", "specd.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        yield log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(5)
