"""The images the live compose test (tests/test_compose_stack.py) runs, and the docker engine it
builds them on.

No registry can be pulled from here, so the test makes its own images: a Debian base by
debootstrap + `docker import` (passed to the Dockerfile as BASE_IMAGE, as a user passes
python:3.12-slim), a Redis image on that base, and the specd image through the compose file's build
section. Images are tagged by a hash of their inputs and reused while the inputs stay the same;
docker's layer cache covers partial changes. The fixtures are session-scoped; a test module imports
them by name (pytest finds them there).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SPECD_DOCKER_CACHE", "/var/tmp/specd-docker-test"))
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
WHEELS = Path("/opt/wheels")  # this workplace's local wheels (the CPU build of torch)


def sh(*args: str, timeout: float = 600, check: bool = True, env: dict | None = None,
       input: str | bytes | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, timeout=timeout, env={**os.environ, **(env or {})},
                         input=input.encode() if isinstance(input, str) else input)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n"
                             f"{out.stdout.decode()[-4000:]}\n{out.stderr.decode()[-4000:]}")
    return out


def docker_ok() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def docker_engine() -> None:
    """A running docker engine: the one there, else dockerd started here (root only)."""
    if docker_ok():
        return
    if shutil.which("docker") is None or shutil.which("dockerd") is None:
        pytest.skip("no docker engine: docker/dockerd are not installed (scripts/test.sh installs docker.io)")
    if os.geteuid() != 0:
        pytest.skip("no docker engine running, and dockerd needs root to start")
    CACHE.mkdir(parents=True, exist_ok=True)
    log = CACHE / "dockerd.log"
    # Left running on purpose: the next session and CI reuse it (and its image cache).
    with open(log, "ab") as f:
        subprocess.Popen(["dockerd"], stdout=f, stderr=f, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if docker_ok():
            return
        time.sleep(1)
    pytest.skip(f"no docker engine: dockerd did not start within 60 s; {log}:\n{log.read_text()[-2000:]}")


def image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0


def digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def torch_wheel() -> Path | None:
    found = sorted(WHEELS.glob("torch-2.13.0+cpu-*.whl")) if WHEELS.is_dir() else []
    return found[-1] if found else None


@pytest.fixture(scope="session")
def base_image(docker_engine) -> str:
    """A Debian image made here: debootstrap, plus this machine's CA bundle and pip settings.

    The CA bundle and pip.conf carry over what this host needs to reach its package registries;
    a torch wheel on this disk goes in as a find-links folder, as the host's pip has it.
    """
    wheel = torch_wheel()
    pip_conf = "[global]\n" + (f"cert = {CA_BUNDLE}\n" if CA_BUNDLE.exists() else "")
    pip_conf += f"find-links = {WHEELS}\n" if wheel else ""
    tag = "specd-test-base:" + digest(DEBIAN_SUITE, BASE_PACKAGES, pip_conf,
                                      CA_BUNDLE.read_bytes() if CA_BUNDLE.exists() else b"",
                                      wheel.name if wheel else "")
    if image_exists(tag):
        return tag
    if shutil.which("debootstrap") is None:
        pytest.fail("debootstrap is not installed (scripts/test.sh installs it)")
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        rootfs = Path(tmp) / "rootfs"
        sh("debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", DEBIAN_SUITE, str(rootfs),
           DEBIAN_MIRROR, timeout=900)
        if CA_BUNDLE.exists():
            shutil.copy(CA_BUNDLE, rootfs / CA_BUNDLE.relative_to("/"))
        (rootfs / "etc/pip.conf").write_text(pip_conf)
        if wheel:
            (rootfs / WHEELS.relative_to("/")).mkdir(parents=True, exist_ok=True)
            shutil.copy(wheel, rootfs / WHEELS.relative_to("/") / wheel.name)
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["docker", "import", "-", tag], stdin=tar.stdout, capture_output=True,
                                  timeout=600)
        assert tar.wait() == 0 and imported.returncode == 0, imported.stderr.decode()
    return tag


@pytest.fixture(scope="session")
def redis_image(base_image) -> str:
    """Debian's redis-server on the base image (redis:7 cannot be pulled here)."""
    dockerfile = (f"FROM {base_image}\n"
                  "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
                  "--no-install-recommends redis-server redis-tools && rm -rf /var/lib/apt/lists/* "
                  "&& mkdir -p /data\n")
    tag = "specd-test-redis:" + digest(dockerfile)
    if not image_exists(tag):
        sh("docker", "build", "-t", tag, "-", input=dockerfile, timeout=900)
    return tag


def image_inputs_digest(base: str) -> str:
    """What the specd image is built from: the Dockerfile's inputs and the base image's id."""
    base_id = sh("docker", "image", "inspect", "-f", "{{.Id}}", base).stdout.decode().strip()
    parts: list[bytes | str] = [base_id]
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml"):
        parts += [name, (ROOT / name).read_bytes()]
    for top in ("specd", "services", "models"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                parts += [str(path.relative_to(ROOT)), path.read_bytes()]
    return digest(*parts)


@pytest.fixture(scope="session")
def specd_image(base_image) -> str:
    """The specd image, built through the compose file's build section (skipped when unchanged)."""
    tag = "specd:test-" + image_inputs_digest(base_image)
    if not image_exists(tag):
        # An empty TORCH_INDEX_URL: torch comes from the base image's find-links folder.
        env = {"SPECD_IMAGE": tag, "BASE_IMAGE": base_image,
               "TORCH_INDEX_URL": "" if torch_wheel() else os.environ.get("TORCH_INDEX_URL",
                                                                         "https://download.pytorch.org/whl/cpu")}
        t0 = time.monotonic()
        sh("docker-compose", "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"),
           "build", "models", env=env, timeout=3000)
        print(f"\nbuilt {tag} in {time.monotonic() - t0:.0f} s")
    return tag
