#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The compose test validates docker-compose.yml with Debian's docker-compose.
if ! command -v docker-compose >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing docker-compose (Debian package) for the compose test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose) >/dev/null 2>&1 \
    || echo "could not install docker-compose; tests/test_compose.py will fail"
fi
exec .venv/bin/python -m pytest -q "$@"
