"""docker-compose's files: they validate (Debian's docker-compose `config`, for the CPU file and
with the GPU override) and every container command is a real `specd` command line; the override
changes nothing but the device, healthchecks and service addresses name the ports the commands
listen on, the model paths are variables and the header of docker-compose.yml lists every variable.

No docker engine is needed here; tests/test_compose_stack.py brings the stack up for real.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from specd.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_SETS = [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]]
SPECD_SERVICES = ("gateway", "verifier", "drafter", "grammar")
COMPOSE_VARIABLES = {"BASE_IMAGE", "TORCH_INDEX_URL", "PIP_INDEX_URL", "REDIS_IMAGE"}


def rendered(files: list[str], env: dict | None = None) -> dict:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed (scripts/test.sh installs Debian's docker-compose)")
    args = ["docker-compose", "--project-directory", str(ROOT)]
    for f in files:
        args += ["-f", str(ROOT / f)]
    # The files' own defaults, whatever this shell exports: only `env` sets compose variables.
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_") and k not in COMPOSE_VARIABLES}
    out = subprocess.run(args + ["config"], capture_output=True, text=True, timeout=60,
                         env={**clean, **(env or {})})
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


# ---- the files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("files", COMPOSE_SETS, ids=["cpu", "gpu"])
def test_compose_config_validates_and_commands_parse(files):
    services = rendered(files)["services"]
    assert {"redis", "models", *SPECD_SERVICES} <= set(services)
    parser = build_parser()
    for name in SPECD_SERVICES:
        args = parser.parse_args(services[name]["command"])  # SystemExit on an unknown flag
        assert args.command == name
        assert "healthcheck" in services[name]
    gpu = [n for n in ("verifier", "drafter")
           if services[n].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")]
    is_gpu = "docker-compose.gpu.yml" in files
    assert gpu == (["verifier", "drafter"] if is_gpu else [])
    for name in ("verifier", "drafter"):
        assert parser.parse_args(services[name]["command"]).device == ("cuda" if is_gpu else "cpu")
    # One image for every specd service, built by one service only (so `up --scale` never rebuilds).
    images = {services[n]["image"] for n in ("models", *SPECD_SERVICES)}
    assert images == {"specd:gpu" if is_gpu else "specd:latest"}
    assert [n for n, s in services.items() if "build" in s] == ["models"]
    args = services["models"]["build"]["args"]
    assert ("nvidia/cuda" in args["BASE_IMAGE"]) == is_gpu
    assert args["TORCH_INDEX_URL"].endswith("/cu128" if is_gpu else "/cpu")
    # The gateway publishes the ports its command listens on.
    gateway = parser.parse_args(services["gateway"]["command"])
    published = {int(p["target"]) if isinstance(p, dict) else int(str(p).split(":")[-1].split("/")[0])
                 for p in services["gateway"]["ports"]}
    assert {gateway.port, gateway.grpc_port} <= published


def test_gpu_override_changes_only_the_device():
    """The override repeats the commands (compose replaces lists); nothing but --device may differ."""
    cpu, gpu = (rendered(files)["services"] for files in COMPOSE_SETS)
    for name in ("verifier", "drafter"):
        a, b = cpu[name]["command"], gpu[name]["command"]
        i = a.index("--device")
        assert a[:i + 1] + a[i + 2:] == b[:i + 1] + b[i + 2:], name


def test_healthchecks_probe_the_ports_the_commands_listen_on():
    services = rendered(COMPOSE_SETS[0])["services"]
    parser = build_parser()
    for name in SPECD_SERVICES:
        test = services[name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "specd"]
        probe = parser.parse_args(test[2:])
        assert probe.command == "healthcheck"
        args = parser.parse_args(services[name]["command"])
        port = args.admin_port if name == "verifier" else args.port
        target = probe.target.rsplit(":", 1)[-1].split("/")[0]
        assert int(target) == port, f"{name}: probes {probe.target}, listens on {port}"


@pytest.mark.parametrize("files", COMPOSE_SETS, ids=["cpu", "gpu"])
def test_service_addresses_point_at_listening_ports(files):
    """--drafter / --grammar addresses name a compose service whose command listens on that port."""
    services = rendered(files)["services"]
    parser = build_parser()
    ports = {name: parser.parse_args(services[name]["command"]).port for name in ("drafter", "grammar")}
    for name in ("verifier", "gateway"):
        args = parser.parse_args(services[name]["command"])
        addresses = [a for a in [getattr(args, "drafter", ""), args.grammar] if a]
        for address in ",".join(addresses).split(","):
            host, port = address.rsplit(":", 1)
            assert host in ports and int(port) == ports[host], f"{name}: {address}"
        assert args.redis_url == "redis://redis:6379/0"


def test_model_paths_are_variables():
    """SPECD_MODELS / SPECD_MODEL / SPECD_DRAFT_MODEL switch every service to other checkpoints."""
    env = {"SPECD_MODELS": "/srv/real-models", "SPECD_MODEL": "/models/small-target",
           "SPECD_DRAFT_MODEL": "/models/small-eagle3"}
    services = rendered(COMPOSE_SETS[0], env)["services"]
    parser = build_parser()
    for name in SPECD_SERVICES:
        assert parser.parse_args(services[name]["command"]).model == "/models/small-target"
        sources = {str(v["source"]) if isinstance(v, dict) else v.split(":")[0]
                   for v in services[name]["volumes"]}
        assert sources == {"/srv/real-models"}
    assert parser.parse_args(services["drafter"]["command"]).speculative_draft_model == "/models/small-eagle3"
    assert services["models"]["environment"]["SPECD_MODEL"] == "/models/small-target"


def test_every_variable_is_documented_in_the_header():
    header = (ROOT / "docker-compose.yml").read_text().split("\nversion:")[0]
    for f in ("docker-compose.yml", "docker-compose.gpu.yml"):
        for name in set(re.findall(r"\$\{([A-Z_]+)", (ROOT / f).read_text())):
            assert name in header, f"{f} reads ${{{name}}}, which docker-compose.yml's header does not list"
