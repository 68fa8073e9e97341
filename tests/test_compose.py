"""docker-compose, for real: the files validate and every container command is a real `specd`
command line; then the stack is built from a local base image, brought up with Debian's
docker-compose, served through the OpenAI client, scaled to two verifiers and two drafters, given
64 requests (spread over both verifiers, each answered once) and torn down.

No registry can be pulled from here, so the live test makes its own images: a Debian base by
debootstrap + `docker import` (passed to the Dockerfile as BASE_IMAGE, as a user passes
python:3.12-slim), and a Redis image on that base. Images are tagged by a hash of their inputs
and reused while the inputs stay the same; docker's layer cache covers partial changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
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


# ---- the live stack ----------------------------------------------------------------------------
CACHE = Path(os.environ.get("SPECD_DOCKER_CACHE", "/var/tmp/specd-docker-test"))
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
WHEELS = Path("/opt/wheels")  # this workplace's local wheels (the CPU build of torch)
NUM_REQUESTS = 64
MAX_TOKENS = 8
LONG_TOKENS = 96


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """One compose project of the stack, driven through docker-compose."""

    def __init__(self, env: dict[str, str]) -> None:
        self.project = f"specdtest{uuid.uuid4().hex[:8]}"
        self.env = env

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return sh("docker-compose", "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"),
                  "-p", self.project, *args, env=self.env, timeout=timeout, check=check)

    def containers(self, service: str) -> list[str]:
        out = self.compose("ps", "-q", service).stdout.decode().split()
        return sorted(out)

    def health(self, container: str) -> str:
        out = sh("docker", "inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{end}}", container)
        return out.stdout.decode().strip()

    def wait_healthy(self, counts: dict[str, int], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            state = {s: [self.health(c) for c in self.containers(s)] for s in counts}
            if all(len(v) == counts[s] and all(h == "healthy" for h in v) for s, v in state.items()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy within {timeout:.0f} s: {state}\n{self.logs()}")
            time.sleep(2)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False).stdout.decode()[-12000:]

    def verifier_stats(self) -> dict[str, int]:
        """consumer name -> requests finished, from each verifier's admin port."""
        return {c: v[0] for c, v in self.verifier_counts().items()}

    def verifier_counts(self) -> dict[str, tuple[int, int]]:
        """consumer name -> (finished, running), both read in one Stats call per verifier."""
        probe = ("import grpc, json; from specd.v1 import verifier_pb2 as p, verifier_pb2_grpc as g; "
                 "s = g.VerifierAdminStub(grpc.insecure_channel('127.0.0.1:50071'))"
                 ".Stats(p.VerifierStatsRequest(), timeout=10); "
                 "print(json.dumps([s.consumer, s.num_finished, s.num_running]))")
        stats = {}
        for c in self.containers("verifier"):
            consumer, num_finished, num_running = json.loads(sh("docker", "exec", c, "python3", "-c", probe).stdout)
            stats[consumer] = (num_finished, num_running)
        return stats


@pytest.fixture(scope="module")
def stack(specd_image, redis_image):
    http_port = free_port()
    env = {"SPECD_IMAGE": specd_image, "REDIS_IMAGE": redis_image, "SPECD_BIND_ADDRESS": "127.0.0.1",
           "SPECD_HTTP_PORT": str(http_port), "SPECD_GRPC_PORT": str(free_port()),
           # A batch of 8 per verifier: 64 requests at once cannot all land on the first verifier
           # that reads the stream, as they would with room for 64.
           "SPECD_MAX_BATCH_SIZE": "8"}
    s = Stack(env)
    s.http_port = http_port
    t0 = time.monotonic()
    try:
        s.compose("up", "-d", "--no-build", timeout=900)
        s.wait_healthy({"gateway": 1, "verifier": 1, "drafter": 1, "grammar": 1})
        print(f"\nstack {s.project} up and healthy in {time.monotonic() - t0:.0f} s")
        yield s
    finally:
        s.compose("down", "-v", "--remove-orphans", "-t", "30", timeout=300, check=False)


def client(stack: Stack):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="none",
                         timeout=300, max_retries=0)


@pytest.mark.docker
def test_compose_stack_serves_scales_and_drains(stack):
    oai = client(stack)
    model = oai.models.list().data[0].id
    # Plain, streamed and structured requests through the OpenAI client, one verifier.
    reply = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens > 0
    chunks = list(oai.completions.create(model=model, prompt="Shanghai is", max_tokens=MAX_TOKENS,
                                         stream=True, temperature=0))
    assert "".join(c.choices[0].text for c in chunks if c.choices) and chunks
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    structured = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a number"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    if structured.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(structured.choices[0].message.content)["n"], int)

    # Scale out: two verifiers in one consumer group, two drafters behind one DNS name.
    t0 = time.monotonic()
    stack.compose("up", "-d", "--no-build", "--scale", "verifier=2", "--scale", "drafter=2", timeout=900)
    stack.wait_healthy({"gateway": 1, "verifier": 2, "drafter": 2, "grammar": 1})
    print(f"\nscaled to 2 verifiers + 2 drafters in {time.monotonic() - t0:.0f} s")
    newest = max(stack.containers("verifier"),
                 key=lambda c: sh("docker", "inspect", "-f", "{{.Created}}", c).stdout.decode())
    resolved = [line for line in sh("docker", "logs", newest).stderr.decode().splitlines()
                if "drafters resolved" in line]
    found = re.findall(r'addresses="?([^" ]+)', resolved[-1]) if resolved else []
    assert found and len(found[0].split(",")) == 2, f"the new verifier found {resolved}"

    before = stack.verifier_stats()
    assert len(before) == 2
    prompts = [f"request {i}: tell me about {i}" for i in range(NUM_REQUESTS)]

    def ask(prompt: str):
        r = oai.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                   extra_body={"ignore_eos": True})
        return r.id, r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(ask, prompts))
    elapsed = time.monotonic() - t0
    after = stack.verifier_stats()
    served = {c: after[c] - before.get(c, 0) for c in after}
    print(f"\n{NUM_REQUESTS} requests in {elapsed:.1f} s; finished per verifier: {served}")
    assert len({a[0] for a in answers}) == NUM_REQUESTS  # one answer per request
    assert all(a[2] == "length" and a[3] == MAX_TOKENS for a in answers), answers
    assert sum(served.values()) == NUM_REQUESTS, served  # each request finished once, by one verifier
    assert all(n > 0 for n in served.values()), f"not spread over both verifiers: {served}"
    # Nothing left pending in the consumer group: every entry was acknowledged.
    redis_container = stack.containers("redis")[0]
    pending = sh("docker", "exec", redis_container, "redis-cli", "XPENDING", "specd:requests", "verifiers")
    assert pending.stdout.decode().split()[0] == "0", pending.stdout.decode()

    # SIGTERM drains: a verifier stops admitting, finishes the requests it runs, then exits 0.
    # Long requests, so that they are still decoding when the signal arrives.
    def ask_long(prompt: str):
        r = oai.completions.create(model=model, prompt=prompt, max_tokens=LONG_TOKENS, temperature=0,
                                   extra_body={"ignore_eos": True})
        return r.choices[0].finish_reason, r.usage.completion_tokens

    finished = sum(stack.verifier_stats().values())
    with ThreadPoolExecutor(max_workers=8) as pool:
        late = [pool.submit(ask_long, f"late {i}") for i in range(8)]
        # Wait until all 8 are admitted (a request still queued at SIGTERM is rightly left for
        # another verifier) and at least one is still decoding.
        deadline = time.monotonic() + 120
        while True:
            counts = stack.verifier_counts().values()
            running, done = sum(c[1] for c in counts), sum(c[0] for c in counts) - finished
            if running + done == 8 and running > 0:
                break
            assert time.monotonic() < deadline and running + done <= 8, (running, done)
            time.sleep(0.2)
        victims = stack.containers("verifier")
        stack.compose("stop", "-t", "120", "verifier", timeout=300)
        codes = [sh("docker", "inspect", "-f", "{{.State.ExitCode}}", c).stdout.decode().strip() for c in victims]
        assert codes == ["0", "0"], f"verifier exit codes after SIGTERM: {codes}\n{stack.logs()}"
        # Every verifier is gone now, so whatever was answered was finished by the drain.
        assert [f.result(timeout=60) for f in late] == [("length", LONG_TOKENS)] * 8
