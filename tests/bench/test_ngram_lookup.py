"""bench/ngram_lookup.py: the n-gram drafter's index against the scan, proposing the same drafts."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ngram_lookup_bench_runs_and_both_sides_agree():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "ngram_lookup.py"), "--batches", "1,3",
                          "--prompt-len", "96", "--steps", "4", "--phrases", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr  # the script asserts the index and the scan agree
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| 1 ") or line.startswith("| 3 ")]
    assert len(rows) == 2
    for row in rows:
        index_ms, scan_ms = float(row[2]), float(row[3])
        assert index_ms > 0 and scan_ms > 0
        assert float(row[5]) > 0.5  # text-like histories: most steps find a continuation
