"""bench/result_join.py: the reader that cuts its blocked read short against the one that waits."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_result_join_bench_runs_and_cutting_the_read_short_is_faster():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "result_join.py"), "--requests", "4",
                          "--block-ms", "400"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    medians = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in out.stdout.splitlines()
               if line.startswith("| cuts") or line.startswith("| waits")}
    assert len(medians) == 2, out.stdout
    cut, wait = medians["cuts the read short (CLIENT UNBLOCK)"], medians["waits for the read"]
    assert cut < 100 < wait, out.stdout  # waiting sits out most of a 400 ms block
