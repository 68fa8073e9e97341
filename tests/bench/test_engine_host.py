"""bench/engine_host.py: the engine's host time per step with the forward body stubbed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_engine_host_bench_runs_every_batch_with_every_draft_accepted():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_host.py"), "--batches", "1,4",
                          "--steps", "5"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr  # the script asserts the stub accepted every draft
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert len(rows) == 2, out.stdout
    for row in rows:
        assert 0 < float(row[2]) < 1e6  # median us per step
