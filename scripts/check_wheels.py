"""Check that a folder of wheels installs on the GPU image with nothing missing (no pip there).

    .venv/bin/python scripts/check_wheels.py .whl [--kinds /work/.library/device/KINDS.md]

For every wheel: its tags must install on CPython 3.12, manylinux x86_64; its project must appear
once (two versions stop pip's whole install). For every Requires-Dist whose marker holds there
(Python 3.12, Linux x86_64, no extras): the requirement must be met by a wheel in the folder, at a
version the specifier allows, or by a package the image already holds (KINDS.md's list, copied
below; `--kinds` re-reads it). Image packages of known version (the pip list row) are checked
against the specifier; for the others the requirement is listed as assumed. Exit 1 on any miss.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# KINDS.md, "Python packages already there" (image 'cuda', read 2026-11-17).
IMAGE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
"""
# KINDS.md's pip list row (versions seen there).
IMAGE_VERSIONS = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2", "torch": "2.11.0",
    "transformers": "5.17.0", "triton": "3.6.0", "onnx": "1.23.1",
}
TARGET_ENV = dict(default_environment(), python_version="3.12", python_full_version="3.12.3",
                  implementation_name="cpython", platform_python_implementation="CPython",
                  sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
                  os_name="posix", extra="")


def image_packages(kinds: Path | None) -> set[str]:
    text = IMAGE_PACKAGES
    if kinds is not None:
        match = re.search(r"Packages: (.*?)\.\s*$", kinds.read_text(), re.M)
        if not match:
            raise SystemExit(f"{kinds}: no 'Packages: ...' line")
        text = match.group(1).replace(",", " ")
    return {canonicalize_name(n) for n in text.split()}


def tag_installs(tag) -> bool:
    """Whether one wheel tag installs on CPython 3.12, manylinux x86_64."""
    interp, abi, plat = tag.interpreter, tag.abi, tag.platform
    plat_ok = plat == "any" or (plat.startswith("manylinux") and plat.endswith("x86_64"))
    if interp in ("py3", "py312", "cp312"):
        return plat_ok and abi in ("none", "cp312", "abi3")
    m = re.fullmatch(r"cp3(\d+)", interp)
    return bool(m) and int(m.group(1)) <= 12 and abi == "abi3" and plat_ok


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode("utf-8"))
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def check(folder: Path, kinds: Path | None = None) -> tuple[list[str], list[str]]:
    """(errors, assumptions) for the wheels in folder."""
    errors, assumed = [], []
    have: dict[str, list[Version]] = {}
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        errors.append(f"no wheels in {folder}")
    for w in wheels:
        name, version, _, tags = parse_wheel_filename(w.name)
        have.setdefault(name, []).append(version)
        if not any(tag_installs(t) for t in tags):
            errors.append(f"{w.name}: no tag installs on cp312 manylinux x86_64")
    for name, versions in have.items():
        if len(versions) > 1:
            errors.append(f"{name}: {len(versions)} versions {sorted(map(str, versions))} (keep one)")
    image = image_packages(kinds)
    for w in wheels:
        for req in requirements(w):
            if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
                continue  # an extra, or another platform / Python
            name = canonicalize_name(req.name)
            where = f"{w.name} needs {req}"
            if name in have:
                if not any(req.specifier.contains(v, prereleases=True) for v in have[name]):
                    errors.append(f"{where}: .whl has {[str(v) for v in have[name]]}")
            elif name in image:
                known = IMAGE_VERSIONS.get(name)
                if known is not None and not req.specifier.contains(known, prereleases=True):
                    errors.append(f"{where}: the image has {known}")
                elif known is None and str(req.specifier):
                    assumed.append(f"{where}: the image's version is unknown here")
            else:
                errors.append(f"{where}: neither in .whl nor in the image")
    return errors, assumed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--kinds", type=Path, default=None, help="re-read the image's package list from KINDS.md")
    args = ap.parse_args(argv)
    errors, assumed = check(args.folder, args.kinds)
    for line in assumed:
        print("assumed:", line)
    for line in errors:
        print("MISSING:", line)
    n = len(list(args.folder.glob("*.whl")))
    print(f"{n} wheels: {'complete' if not errors else f'{len(errors)} problem(s)'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
