#!/usr/bin/env bash
# The main job: set up (if needed), serve the whole stack (embedded Redis, drafter, grammar,
# verifier, gateway) on the trained small model family in models/ with its EAGLE-3 head, send a
# sample request through the OpenAI client, print the completion and the acceptance figures, and
# keep serving until Ctrl-C. SPECD_DEMO_EXIT=1 stops after the sample request.
# SPECD_MODEL / SPECD_DRAFT_MODEL serve other checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL="${SPECD_MODEL:-models/specd-py-target}"
DRAFT="${SPECD_DRAFT_MODEL:-models/specd-py-eagle3}"
PORT="${SPECD_PORT:-23333}"
.venv/bin/specd serve api_server "$MODEL" --backend pytorch --server-port "$PORT" \
  --speculative-algorithm eagle3 --speculative-draft-model "$DRAFT" \
  --speculative-num-draft-tokens 3 --max-batch-size 32 --enable-metrics --log-level warning &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER' EXIT
for _ in $(seq 600); do
  .venv/bin/specd healthcheck http "http://127.0.0.1:$PORT/health" 2>/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "the stack failed to start"; exit 1; }
  sleep 0.5
done
.venv/bin/python examples/openai_client.py "$PORT"
echo "serving on http://0.0.0.0:$PORT/v1 (metrics on /metrics); Ctrl-C stops everything"
[ "${SPECD_DEMO_EXIT:-0}" = 1 ] || wait $SERVER
