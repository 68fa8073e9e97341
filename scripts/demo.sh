#!/usr/bin/env bash
# Set up (if needed), write the tiny checkpoints, and run the seed's pipeline example with EAGLE-3.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODELS="${SPECD_TINY_MODELS:-.tiny-models}"
[ -f "$MODELS/draft-eagle3/config.json" ] || .venv/bin/specd make-tiny-models "$MODELS"
.venv/bin/python examples/pipeline_eagle3.py "$MODELS/target-llama" "$MODELS/draft-eagle3"
