# specd: one image, one `specd` entrypoint; the service is the command (gateway, verifier, drafter, ...).
# The base image is a build argument so users pick their registry and CUDA flavour:
#   docker build --build-arg BASE_IMAGE=python:3.11-slim -t specd .                       (CPU)
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.0-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t specd:gpu .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# pip must exist in the base image; Debian/Ubuntu bases without Python get it from apt.
RUN if ! command -v python3 >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv && \
      rm -rf /var/lib/apt/lists/*; \
    fi && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url ${TORCH_INDEX_URL}} torch==${TORCH_VERSION}

WORKDIR /opt/specd
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY specd ./specd
COPY services ./services
RUN pip install --no-cache-dir .

ENTRYPOINT ["specd"]
CMD ["--help"]
