#!/usr/bin/env bash
# The GPU fast-path suite in one call (issue 5): verify-step bench, then end to end through the
# services. Usage: bash bench/gpu_suite.sh OUT_DIR [extra `python -m bench` flags]
# Expected on one H200: ~1-2 min step bench, ~4-6 min e2e (5 stacks); hard cap 540 s. Results are
# written as they come (OUT_DIR/step.md, OUT_DIR/e2e.md, OUT_DIR/summary.md), so a cut-short run
# keeps every finished table. Logs: OUT_DIR/bench.log.
set -euo pipefail
OUT="${1:?usage: bash bench/gpu_suite.sh OUT_DIR [flags]}"
shift || true
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1 || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$OUT/gpu.txt" 2>&1 || true
# Work files (the synthetic 8B checkpoint, ~16 GB) go to local disk, not into the results.
WORK="${BENCH_WORK_DIR:-/tmp/specd-bench-work}"
timeout -k 10 540 "$PY" -m bench all --out "$OUT" --work-dir "$WORK" "$@" 2>&1 | tee "$OUT/bench.log"
