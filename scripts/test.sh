#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian packages of the compose and deploy tests: docker-compose and docker.io (the engine; the
# compose test starts dockerd itself when none runs), debootstrap (its base image), and kubectl
# for `kubectl kustomize` (Debian's kubernetes-client, where no kubectl is installed already).
export PATH="$PATH:/usr/sbin:/sbin"  # dockerd and debootstrap live in sbin
missing=""
for pair in docker-compose:docker-compose dockerd:docker.io debootstrap:debootstrap kubectl:kubernetes-client; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing="$missing ${pair#*:}"
done
if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian packages for the compose and deploy tests:$missing"
  (dpkg --configure -a && apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing) >/dev/null 2>&1 \
    || echo "could not install$missing; tests/test_compose*.py and tests/deploy will fail or skip"
fi
exec .venv/bin/python -m pytest -q "$@"
