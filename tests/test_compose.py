"""docker-compose files validate, and every container command is a real `specd` command line."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from specd.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_SETS = [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]]


def rendered(files: list[str]) -> dict:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed (.ci/run installs Debian's docker-compose)")
    args = ["docker-compose", "--project-directory", str(ROOT)]
    for f in files:
        args += ["-f", str(ROOT / f)]
    out = subprocess.run(args + ["config"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@pytest.mark.parametrize("files", COMPOSE_SETS, ids=["cpu", "gpu"])
def test_compose_config_validates_and_commands_parse(files):
    config = rendered(files)
    services = config["services"]
    assert {"redis", "models", "gateway", "verifier", "drafter", "grammar"} <= set(services)
    parser = build_parser()
    for name in ("gateway", "verifier", "drafter", "grammar"):
        command = services[name]["command"]
        args = parser.parse_args(command)  # raises SystemExit on an unknown flag
        assert args.command == name
        assert "healthcheck" in services[name]
    gpu = [n for n in ("verifier", "drafter")
           if services[n].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")]
    assert gpu == (["verifier", "drafter"] if "docker-compose.gpu.yml" in files else [])
    # The gateway publishes the ports its command listens on.
    gateway = parser.parse_args(services["gateway"]["command"])
    published = {int(p["target"]) if isinstance(p, dict) else int(str(p).split(":")[-1])
                 for p in services["gateway"]["ports"]}
    assert {gateway.port, gateway.grpc_port} <= published


def test_healthcheck_commands_parse():
    config = rendered(COMPOSE_SETS[0])
    parser = build_parser()
    for name in ("gateway", "verifier", "drafter", "grammar"):
        test = config["services"][name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "specd"]
        assert parser.parse_args(test[2:]).command == "healthcheck"


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
