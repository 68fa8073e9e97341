"""Run a snippet under Triton's interpreter (TRITON_INTERPRET=1), in a subprocess: the variable
must be set before triton.jit decorates a kernel, i.e. before specd's kernel modules import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, timeout: int = 600) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
