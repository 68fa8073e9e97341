"""Every `SPECD_*` environment variable, registered once.

A setting is one of three kinds:
- configuration: what a deployment sets (a command-line flag comes first where a command has one;
  the variable is its default, for containers and compose files);
- fallback: turns a fast path off where it cannot run (an old GPU, a firewall), documented;
- diagnostic: traces, and switches that turn an adopted mechanism off so a bench can time what it
  gains;
- tooling: the tests' and benches' own knobs (caches, strides), read by nothing that serves.
Deployment variables that only docker-compose.yml and the Kubernetes manifests read are
configuration too: those files pass them on as the services' flags.

Modules read a setting through `SETTING.get()`, which parses and validates the value and names
the variable in its error. docs/settings.md is generated from this table
(`python -m specd.settings > docs/settings.md`), and tests/test_settings.py fails on a `SPECD_`
name anywhere in the repository that is not registered here, or on a stale docs/settings.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

KINDS = ("configuration", "fallback", "diagnostic", "tooling")


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str
    default: Any
    values: str  # the accepted values, as the docs show them
    help: str
    readers: tuple[str, ...]  # the files that read it (compose files and scripts included)
    parse: Callable[[str], Any] = str
    flag: str = ""  # the command-line flag that sets the same thing, where one exists
    # The benches' A/B columns: a method's name with the suffix runs its stack with this value
    # ("replay-sync": SPECD_DRAFT_AHEAD=0), bench/e2e.py's VARIANTS.
    variants: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        assert self.name.startswith("SPECD_") and self.kind in KINDS, self

    def get(self) -> Any:
        """The variable's parsed value, or the default when unset or empty."""
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None


def switch(raw: str) -> bool:
    """"1" on, "0" off."""
    if raw not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return raw == "1"


def choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return raw
    return parse


def at_least(low: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)  # ValueError names the text
        if value < low:
            raise ValueError(f"expected an integer >= {low}")
        return value
    return parse


def probability(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value <= 1.0:
        raise ValueError("expected a number in [0, 1]")
    return value


_REGISTRY: dict[str, Setting] = {}


def register(*args, **kwargs) -> Setting:
    setting = Setting(*args, **kwargs)
    assert setting.name not in _REGISTRY, setting.name
    _REGISTRY[setting.name] = setting
    return setting


def registered() -> dict[str, Setting]:
    return dict(_REGISTRY)


def bench_variants() -> dict[str, dict[str, str]]:
    """Every registered A/B suffix -> the environment it sets ({"-sync": {"SPECD_DRAFT_AHEAD": "0"}})."""
    return {suffix: {s.name: value} for s in _REGISTRY.values() for suffix, value in s.variants}


# -- configuration ------------------------------------------------------------------------------
API_KEYS = register(
    "SPECD_API_KEYS", "configuration", "", "comma-separated keys",
    "API keys every /v1 route and gRPC Generate require (Authorization: Bearer KEY)",
    ("services/common/api_keys.py", "services/gateway/cli.py", "services/launcher/supervisor.py"),
    flag="--api-keys")
DEFAULT_MODELS = register(
    "SPECD_DEFAULT_MODELS", "configuration", "", "a folder",
    "where the trained default family is (else models/ beside the package, then /opt/specd/models)",
    ("specd/default_models.py",), flag="install-default-models --source")
DRAFTER_FAST_STEP_PORT = register(
    "SPECD_DRAFTER_FAST_STEP_PORT", "configuration", 0, "a port; 0 any free one; -1 off",
    "the drafter's plain-TCP port for the per-step round trip", ("services/drafter/cli.py",),
    parse=at_least(-1), flag="--fast-step-port")
REPLAY_REFERENCES = register(
    "SPECD_REPLAY_REFERENCES", "configuration", "", "a JSON-lines file",
    "the replay drafter's (bench only) prompts and their greedy continuations",
    ("services/drafter/cli.py",), flag="--replay-references")
REPLAY_CORRUPT_RATE = register(
    "SPECD_REPLAY_CORRUPT_RATE", "configuration", 0.0, "a probability",
    "the replay drafter's chance of corrupting a draft (sets its acceptance)",
    ("services/drafter/cli.py",), parse=probability, flag="--replay-corrupt-rate")

# -- fallbacks ----------------------------------------------------------------------------------
KERNELS = register(
    "SPECD_KERNELS", "fallback", "auto", "auto | off",
    "off: PyTorch ops instead of specd's Triton kernels (what runs on CPU)",
    ("specd/models/llama_runner.py",), parse=choice("auto", "off"))
GEMM = register(
    "SPECD_GEMM", "fallback", "auto", "auto | torch",
    "torch: cuBLAS (F.linear) for every product instead of the skinny GEMM kernel",
    ("specd/models/linear.py", "specd/models/llama_runner.py"), parse=choice("auto", "torch"))
PDL = register(
    "SPECD_PDL", "fallback", "auto", "auto | off (0)",
    "off: kernels launch plainly, without programmatic dependent launch (Hopper)",
    ("specd/models/kernels/pdl.py",), parse=lambda raw: choice("auto", "off")({"0": "off", "1": "auto"}.get(raw, raw)),
    variants=(("-nopdl", "off"),))
DRAFTER_FAST_PATH = register(
    "SPECD_DRAFTER_FAST_PATH", "fallback", True, "1 | 0",
    "0: the verifier keeps its drafter steps on the gRPC stream (where the fast port is firewalled)",
    ("specd/clients/drafter_stream.py",), parse=switch, variants=(("-grpcsteps", "0"),))

# -- diagnostics --------------------------------------------------------------------------------
TRACE_STEPS = register(
    "SPECD_TRACE_STEPS", "diagnostic", "", "FIRST:COUNT",
    "trace the verifier's steps FIRST .. FIRST+COUNT-1 (torch profiler, Chrome trace)",
    ("specd/step_trace.py", "services/verifier/worker.py"), variants=(("-trace", "100:40"),))
DRAFTER_TRACE_STEPS = register(
    "SPECD_DRAFTER_TRACE_STEPS", "diagnostic", "", "FIRST:COUNT",
    "trace the drafter's steps the same way", ("specd/step_trace.py", "services/drafter/server.py"),
    variants=(("-dtrace", "100:40"),))
TRACE_DIR = register(
    "SPECD_TRACE_DIR", "diagnostic", ".", "a folder", "where step traces are written",
    ("specd/step_trace.py",))
GRAPH_DEBUG_DIR = register(
    "SPECD_GRAPH_DEBUG_DIR", "diagnostic", "", "a folder",
    "dump each captured CUDA graph (DOT) there, and capture in debug mode",
    ("specd/models/cuda_graphs.py",))
DRAFT_AHEAD = register(
    "SPECD_DRAFT_AHEAD", "diagnostic", True, "1 | 0",
    "0: drafts are asked for inside each step instead of right after the previous commit",
    ("specd/engine/engine.py",), parse=switch, variants=(("-sync", "0"),))
DRAFT_CARRY = register(
    "SPECD_DRAFT_CARRY", "diagnostic", None, "drafts past k; default 2(k + 1) for lookup drafters",
    "how many drafts past k a lookup drafter's answer carries for later steps",
    ("specd/engine/drafting.py",), parse=at_least(0), variants=(("-nocarry", "0"), ("-carry4", "4")))
STAGE_VERIFY = register(
    "SPECD_STAGE_VERIFY", "diagnostic", True, "1 | 0",
    "0: the next verify batch is built after the drafts arrive, not while they are out",
    ("specd/engine/staging.py",), parse=switch, variants=(("-stage", "1"), ("-nostage", "0")))
VERIFIER_RIDE_READS = register(
    "SPECD_VERIFIER_RIDE_READS", "diagnostic", True, "1 | 0",
    "0: a busy verifier reads the request stream on a round trip of its own",
    ("services/verifier/worker_types.py",), parse=switch, variants=(("-ownread", "0"),))
VERIFIER_EARLY_FIRST_TOKEN = register(
    "SPECD_VERIFIER_EARLY_FIRST_TOKEN", "diagnostic", True, "1 | 0",
    "0: a request's first token leaves with its step's results, not on a round trip of its own",
    ("services/verifier/worker_types.py", "bench/first_token.py"), parse=switch,
    variants=(("-latefirst", "0"),))
ASYNC_EMIT = register(
    "SPECD_ASYNC_EMIT", "diagnostic", True, "1 | 0",
    "0: the verifier's loop waits for each result round trip (no writer thread)",
    ("services/verifier/cli.py", "bench/services_vs_inprocess.py"), parse=switch, flag="--no-async-emit",
    variants=(("-syncemit", "0"),))


# -- read outside the Python code: deployment variables (docker-compose*.yml, deploy/, scripts/demo.sh,
# passed on to the services as flags) and the tests' and benches' own knobs ------------------------
_COMPOSE = ("docker-compose.yml", "docker-compose.gpu.yml")
_KUSTOMIZE = ("deploy/base/kustomization.yaml",)
for _kind, _name, _values, _help, _readers in (
    ("configuration", "SPECD_MODELS", "a volume or host folder", "mounted at /models (default: the models volume)", ("docker-compose.yml",)),
    ("configuration", "SPECD_MODEL", "a checkpoint path", "the target checkpoint", _COMPOSE + _KUSTOMIZE + ("scripts/demo.sh",)),
    ("configuration", "SPECD_DRAFT_MODEL", "a checkpoint path", "the draft checkpoint", _COMPOSE + _KUSTOMIZE + ("scripts/demo.sh",)),
    ("configuration", "SPECD_SPECULATIVE_ALGORITHM", "a method", "--speculative-algorithm of the verifier and drafter", _COMPOSE + _KUSTOMIZE),
    ("configuration", "SPECD_NUM_DRAFT_TOKENS", "an integer", "--speculative-num-draft-tokens", _COMPOSE + _KUSTOMIZE),
    ("configuration", "SPECD_MAX_BATCH_SIZE", "an integer", "the verifier's --max-batch-size", _COMPOSE + _KUSTOMIZE),
    ("configuration", "SPECD_REDIS_URL", "a redis:// URL", "an external Redis instead of the bundled one", _COMPOSE),
    ("configuration", "SPECD_BIND_ADDRESS", "an address", "where compose publishes the gateway", ("docker-compose.yml",)),
    ("configuration", "SPECD_HTTP_PORT", "a port", "the gateway's published HTTP port", ("docker-compose.yml",)),
    ("configuration", "SPECD_GRPC_PORT", "a port", "the gateway's published gRPC port", ("docker-compose.yml",)),
    ("configuration", "SPECD_IMAGE", "an image tag", "the image compose runs", _COMPOSE),
    ("configuration", "SPECD_LOG_LEVEL", "a logging level", "the services' --log-level", _KUSTOMIZE),
    ("configuration", "SPECD_DEVICE", "cpu | cuda", "the verifier's and drafter's --device", _KUSTOMIZE),
    ("configuration", "SPECD_REQUEST_STREAM", "a stream name", "the Redis request stream (gateway, verifier, autoscaler)", _KUSTOMIZE),
    ("configuration", "SPECD_GRAMMAR_ADDRESS", "host:port", "the grammar service the gateway and verifier use", _KUSTOMIZE),
    ("configuration", "SPECD_DRAFTER_ADDRESS", "host:port", "the drafter service the verifier uses", _KUSTOMIZE),
    ("configuration", "SPECD_PORT", "a port", "the demo's HTTP port", ("scripts/demo.sh",)),
    ("configuration", "SPECD_DEMO_EXIT", "1", "the demo stops after its sample request", ("scripts/demo.sh",)),
    ("tooling", "SPECD_TINY_MODELS", "a folder", "reuse tiny checkpoints written there", ("tests/conftest.py", "bench/__main__.py")),
    ("tooling", "SPECD_DOCKER_CACHE", "a folder", "the compose test's scratch folder", ("tests/compose_images.py",)),
    ("tooling", "SPECD_SERVICES", "service names", "which services the compose test brings up", ("tests/test_compose.py",)),
    ("tooling", "SPECD_SWEEP_STRIDE", "an integer", "the slow schema sweep's stride", ("tests/grammar/test_full_schema_sweep.py",)),
    ("tooling", "SPECD_SWEEP_SAMPLED_STRIDE", "an integer", "its stride for sampled runs", ("tests/grammar/test_full_schema_sweep.py",)),
    ("tooling", "SPECD_SHARED_DIR", "a folder", "where the benches find shared data", ("bench/shared_data.py",)),
    ("tooling", "SPECD_BENCH_TAG", "a tag", "marks the GPU suite's processes for its teardown", ("bench/gpu_suite.sh",)),
    ("tooling", "SPECD_WHEEL_DIR", "a folder", "the wheels the GPU suite installs (default .whl)", ("bench/gpu_suite.sh",)),
):
    register(_name, _kind, "", _values, _help, _readers)


def markdown() -> str:
    """docs/settings.md: one table row per setting."""
    lines = ["# Settings", "",
             "Generated by `python -m specd.settings > docs/settings.md` from specd/settings.py; "
             "tests/test_settings.py checks it is current.", "",
             "| variable | kind | values (default) | flag | what it does | read in |",
             "|---|---|---|---|---|---|"]
    for s in sorted(_REGISTRY.values(), key=lambda s: (KINDS.index(s.kind), s.name)):
        default = "unset" if s.default in ("", None) else repr(s.default)
        cells = (f"`{s.name}`", s.kind, f"{s.values} ({default})", f"`{s.flag}`" if s.flag else "", s.help,
                 ", ".join(s.readers))
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
