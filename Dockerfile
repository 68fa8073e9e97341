# specd: one image, one `specd` entrypoint; the service is the command (gateway, verifier, drafter,
# grammar, make-tiny-models, healthcheck, ...). Compose and the Kubernetes manifests in deploy/ run
# this one image with a different command per service.
#
# The base image is a build argument, so users pick their registry and flavour:
#   CPU:  docker build -t specd .                                   (python:3.12-slim, CPU torch)
#   GPU:  docker build -t specd:gpu \
#           --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 \
#           --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# (`docker compose -f docker-compose.yml -f docker-compose.gpu.yml build` passes the GPU pair.)
# Any Debian/Ubuntu base works: one without Python gets it from apt. A base that already ships
# torch 2.13.0 (in its system site-packages, or on a pip find-links folder) is reused as it is,
# which is how the compose test builds offline-friendly images.
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE} AS python

# Python from the base when it has one (python:*-slim), else from apt (nvidia/cuda, debian, ubuntu).
# --system-site-packages: a base image's preinstalled torch is seen by the venv instead of being
# downloaded again (several GB for CUDA builds).
RUN if ! python3 -c "import venv, ensurepip" >/dev/null 2>&1; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv --system-site-packages /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The runtime dependencies alone, read from pyproject.toml in a stage of their own: the install
# layer below is keyed on this list, so edits elsewhere in pyproject.toml (test extras, tool
# settings) do not reinstall them. (tomllib is 3.11+; pip's vendored tomli before that.)
FROM python AS requirements
COPY pyproject.toml /tmp/
RUN python3 -c "import sys, importlib; toml = importlib.import_module('tomllib' if sys.version_info >= (3, 11) else 'pip._vendor.tomli'); print('\n'.join(toml.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt

FROM python
# An unprivileged user with a numeric id (Kubernetes' runAsNonRoot checks the number). /models is
# created here so a fresh named volume mounted there inherits this owner and the models job can
# copy the default models into it.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin specd \
 && mkdir -p /models && chown specd:specd /models

# A mirror for everything but torch (unset: the pip configuration of the base image, else PyPI).
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
# torch first and in a layer of its own: it is most of the image and changes least often. The CPU
# wheel index keeps a CPU image free of CUDA libraries; empty: pip's default index (on x86-64 PyPI
# serves the CUDA build) or whatever the base image's pip configuration points at.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
      ${PIP_INDEX_URL:+--extra-index-url "$PIP_INDEX_URL"} "torch==${TORCH_VERSION}"

# The other dependencies before the sources: editing specd/ or services/ rebuilds only the last,
# small layer.
COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
RUN pip install ${PIP_INDEX_URL:+--index-url "$PIP_INDEX_URL"} \
      ${PIP_EXTRA_INDEX_URL:+--extra-index-url "$PIP_EXTRA_INDEX_URL"} \
      -r /tmp/requirements.txt "setuptools>=68" wheel \
 && rm /tmp/requirements.txt

WORKDIR /opt/specd
COPY pyproject.toml ./
COPY specd ./specd
COPY services ./services
# The trained default family (32 MB): `specd install-default-models /models` copies it into a volume.
COPY models ./models
# --no-deps --no-build-isolation: everything is installed above; this layer needs no network.
# chmod: checkpoints written by safetensors are 0600; the unprivileged user must read them.
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info \
 && chmod -R a+rX models

USER 10001
WORKDIR /home/specd
# Models are local directories; specd never downloads weights, and neither may transformers.
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# The service ports (documentation: compose and deploy/ publish what they use):
# gateway HTTP 23333 and gRPC 23334, drafter 50061, verifier admin 50071 and metrics 9101, grammar 50081.
EXPOSE 23333 23334 50061 50071 50081 9101
ENTRYPOINT ["specd"]
CMD ["--help"]
