#!/usr/bin/env bash
# Regenerate the Python gRPC stubs (specd/v1/*_pb2*.py) from proto/specd/v1/*.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m specd.protogen "$@"
