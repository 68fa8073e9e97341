"""deploy/ hangs together: every overlay renders with `kubectl kustomize`, and in what it renders
every container runs a real `specd` command whose flags parse (after Kubernetes' $(VAR)
expansion from the ConfigMap, Secret and downward API), probes and Services hit the ports the
commands listen on, every variable is defined and every config key is used, and KEDA watches the
stream and consumer group the services use."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from specd.cli import build_parser
from specd.transport.redis_streams import CONSUMER_GROUP, DEFAULT_REQUEST_STREAM

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = sorted(p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
SERVICES = ("gateway", "verifier", "drafter", "grammar")
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def test_every_overlay_is_tested():
    assert {"cpu", "gpu"} <= set(OVERLAYS)


@pytest.fixture(scope="module", params=["base", *OVERLAYS])
def rendered(request) -> tuple[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not installed (scripts/test.sh installs Debian's kubernetes-client)")
    path = DEPLOY / ("base" if request.param == "base" else f"overlays/{request.param}")
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return request.param, [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def config_of(docs: list[dict]) -> dict[str, str]:
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("specd-config")]
    return config["data"]


def container_env(docs: list[dict], container: dict) -> dict[str, str]:
    """The container's environment as Kubernetes builds it; a missing reference fails the test."""
    configmaps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"{container['name']}: envFrom names ConfigMap {name}, not rendered"
        env.update(configmaps[name]["data"])
    for item in container.get("env", []):
        ref = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "secretKeyRef" in ref:
            secret = secrets[ref["secretKeyRef"]["name"]]
            data = secret.get("stringData", {})
            assert ref["secretKeyRef"]["key"] in data, f"{container['name']}: {item['name']} -> missing key"
            env[item["name"]] = data[ref["secretKeyRef"]["key"]]
        elif "configMapKeyRef" in ref:
            env[item["name"]] = configmaps[ref["configMapKeyRef"]["name"]]["data"][ref["configMapKeyRef"]["key"]]
        elif "fieldRef" in ref:
            env[item["name"]] = f"{ref['fieldRef']['fieldPath'].split('.')[-1]}-value"
        else:
            pytest.fail(f"{container['name']}: env {item['name']} has no value I can check")
    return env


def expand(arg: str, env: dict[str, str], where: str) -> str:
    for name in VAR.findall(arg):
        # Kubernetes leaves an undefined $(NAME) in place: the service would get it literally.
        assert name in env, f"{where}: $({name}) is not defined in the container's environment"
    return VAR.sub(lambda m: env[m.group(1)], arg)


def parsed(docs: list[dict], container: dict, where: str):
    assert container["command"] == ["specd"], f"{where}: runs {container['command']}, not specd"
    env = container_env(docs, container)
    args = [expand(a, env, where) for a in container["args"]]
    return build_parser().parse_args(args)  # SystemExit (a failure) on an unknown flag or value


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def main_container(deployment: dict) -> dict:
    (container,) = [c for c in pod_spec(deployment)["containers"] if c["name"] == deployment["metadata"]["name"]]
    return container


def listening_ports(args) -> set[int]:
    return {p for p in (getattr(args, "port", None), getattr(args, "grpc_port", None),
                        getattr(args, "admin_port", None), getattr(args, "metrics_port", None),
                        getattr(args, "fast_step_port", None)) if p and p > 0}


def test_the_four_services_have_a_deployment_a_service_and_a_budget(rendered):
    _, docs = rendered
    deployments, services, budgets = by_kind(docs, "Deployment"), by_kind(docs, "Service"), \
        by_kind(docs, "PodDisruptionBudget")
    assert set(SERVICES) <= set(deployments)
    assert {"gateway", "drafter", "grammar", "verifier-metrics"} <= set(services)
    assert set(SERVICES) <= set(budgets)
    for name, budget in budgets.items():
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    assert services["drafter"]["spec"]["clusterIP"] == "None"  # headless: DNS lists every pod
    assert "replicas" not in deployments["verifier"]["spec"]  # KEDA owns the verifier count


def test_every_container_command_parses(rendered):
    _, docs = rendered
    for name, deployment in by_kind(docs, "Deployment").items():
        for container in pod_spec(deployment).get("initContainers", []):
            args = parsed(docs, container, f"{name}/{container['name']}")
            assert args.command == "install-default-models"
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert str(args.dir) in mounts
        args = parsed(docs, main_container(deployment), name)
        assert args.command == name
        # The model path given to the service lies on the models volume.
        mounts = {m["mountPath"] for m in main_container(deployment)["volumeMounts"]}
        assert any(args.model.startswith(m + "/") for m in mounts), f"{name}: {args.model} not on {mounts}"


def test_probes_and_services_hit_the_listening_ports(rendered):
    _, docs = rendered
    deployments = by_kind(docs, "Deployment")
    for name, deployment in deployments.items():
        container = main_container(deployment)
        args = parsed(docs, container, name)
        declared = {p["containerPort"] for p in container["ports"]}
        assert declared == listening_ports(args), f"{name}: ports {declared} vs flags {listening_ports(args)}"
        health_port = {"gateway": getattr(args, "grpc_port", None), "verifier": getattr(args, "admin_port", None)
                       }.get(name) or args.port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == health_port, f"{name} {probe}"
    for name, service in by_kind(docs, "Service").items():
        selected = [d for d in deployments.values()
                    if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"Service {name} selects {len(selected)} Deployments"
        named = {p["name"]: p["containerPort"] for p in main_container(selected[0])["ports"]}
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert (named[target] if isinstance(target, str) else target) in named.values(), f"{name}: {port}"


def test_the_drafter_pins_its_fast_step_port(rendered):
    """An ephemeral port (the flag's default 0) cannot be declared, nor opened by a NetworkPolicy or
    a mesh: the verifiers would quietly fall back to the slower gRPC step path."""
    _, docs = rendered
    drafter = parsed(docs, main_container(by_kind(docs, "Deployment")["drafter"]), "drafter")
    assert drafter.fast_step_port > 0
    ports = {p["name"]: p["containerPort"] for p in main_container(by_kind(docs, "Deployment")["drafter"])["ports"]}
    assert ports.get("fast-steps") == drafter.fast_step_port


def service_port(docs: list[dict], address: str) -> tuple[dict, int]:
    """The Service that host:port names, and the container port the Service sends it to."""
    host, port = address.rsplit(":", 1)
    service = by_kind(docs, "Service")[host]
    (entry,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    return service, entry


def test_addresses_name_services_that_reach_the_servers(rendered):
    _, docs = rendered
    deployments = by_kind(docs, "Deployment")
    drafter = parsed(docs, main_container(deployments["drafter"]), "drafter")
    grammar = parsed(docs, main_container(deployments["grammar"]), "grammar")
    for name in ("verifier", "gateway"):
        args = parsed(docs, main_container(deployments[name]), name)
        targets = [(args.grammar, "grammar", grammar.port)]
        if name == "verifier":
            targets.append((args.drafter, "drafter", drafter.port))
        for address, server, port in targets:
            service, entry = service_port(docs, address)
            assert service["metadata"]["name"] == server
            named = {p["name"]: p["containerPort"] for p in main_container(deployments[server])["ports"]}
            assert named[entry["targetPort"]] == port, f"{name} -> {address}"


def test_redis_and_keda_agree_with_the_services(rendered):
    _, docs = rendered
    verifier_container = main_container(by_kind(docs, "Deployment")["verifier"])
    env = container_env(docs, verifier_container)
    verifier = parsed(docs, verifier_container, "verifier")
    gateway = parsed(docs, main_container(by_kind(docs, "Deployment")["gateway"]), "gateway")
    url = urlsplit(verifier.redis_url)
    assert gateway.redis_url == verifier.redis_url
    assert f"{url.hostname}:{url.port or 6379}" == env["REDIS_ADDRESS"]
    assert (url.password or "") == env["REDIS_PASSWORD"]
    assert verifier.request_stream == gateway.request_stream == DEFAULT_REQUEST_STREAM
    (scaled,) = by_kind(docs, "ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"]["name"] == "verifier"
    assert "minReplicaCount" in scaled["spec"] and scaled["spec"]["maxReplicaCount"] > scaled["spec"]["minReplicaCount"]
    kinds = set()
    for trigger in scaled["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert meta["stream"] == verifier.request_stream
        assert meta["consumerGroup"] == CONSUMER_GROUP
        assert meta["databaseIndex"] == (url.path.strip("/") or "0")
        for key in ("addressFromEnv", "passwordFromEnv"):
            assert meta[key] in env, f"KEDA reads {meta[key]}, which the verifier container lacks"
        assert all(isinstance(v, str) for v in meta.values())  # KEDA metadata values are strings
        if "lagCount" in meta:
            assert "activationLagCount" in meta
            kinds.add("lag")
        if "pendingEntriesCount" in meta:
            kinds.add("pending")
            assert int(meta["pendingEntriesCount"]) <= verifier.max_batch_size  # full batches scale up
    assert kinds == {"pending", "lag"}


def test_every_config_key_is_used(rendered):
    _, docs = rendered
    used = set()
    for deployment in by_kind(docs, "Deployment").values():
        for container in pod_spec(deployment)["containers"] + pod_spec(deployment).get("initContainers", []):
            used |= {name for arg in container.get("args", []) for name in VAR.findall(arg)}
    assert set(config_of(docs)) <= used, f"unused ConfigMap keys: {set(config_of(docs)) - used}"


def test_termination_drains(rendered):
    """Grace periods outlast preStop plus the service's own drain time."""
    _, docs = rendered
    deployments = by_kind(docs, "Deployment")
    for name, deployment in deployments.items():
        container, spec = main_container(deployment), pod_spec(deployment)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
        args = parsed(docs, container, name)
        drain = getattr(args, "shutdown_grace", 5.0)
        assert spec["terminationGracePeriodSeconds"] > sleep + drain, name
        if name in ("gateway", "drafter", "grammar"):  # behind Services: leave endpoints first
            assert sleep > 0, f"{name}: no preStop wait"
    assert pod_spec(deployments["verifier"])["terminationGracePeriodSeconds"] >= 120  # a batch's requests


def test_devices_follow_the_overlay(rendered):
    overlay, docs = rendered
    deployments = by_kind(docs, "Deployment")
    for name in SERVICES:
        container = main_container(deployments[name])
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        uses_gpu = overlay == "gpu" and name in ("verifier", "drafter")
        assert (gpus == 1) == uses_gpu, f"{overlay}/{name}: nvidia.com/gpu {gpus}"
        if name in ("verifier", "drafter"):
            assert parsed(docs, container, name).device == ("cuda" if uses_gpu else "cpu")
    images = {c["image"] for d in deployments.values()
              for c in pod_spec(d)["containers"] + pod_spec(d).get("initContainers", [])}
    assert images == {"specd:gpu" if overlay == "gpu" else "specd:latest"}
    if overlay != "base":
        assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"specd"}
