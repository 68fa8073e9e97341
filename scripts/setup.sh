#!/usr/bin/env bash
# Create .venv at the repository root and install specd with its test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first, pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
# (grep drops pip's notes about absent local mirror folders; errors still fail the pipeline)
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }
quiet .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
quiet .venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
