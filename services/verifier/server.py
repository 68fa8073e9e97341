"""Process wiring of `specd verifier`: load the model, start the admin and metrics ports, run the loop.

Order: logging and signal handlers first, then the admin port (health NOT_SERVING while the model
loads), the tokenizer and engine, the Redis connection and consumer group, then health SERVING and
the loop in the main thread. SIGTERM (or SIGINT) drains: no new requests, the running ones finish,
then the process exits 0; a second signal stops at once, leaving unanswered entries pending.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field

from services.verifier.claims import ClaimConfig
from services.common.tls import PLAINTEXT, TLSConfig, channel_credentials, server_credentials
from specd.messages import SPECULATIVE_METHODS, ConfigError, PytorchEngineConfig, SpeculativeConfig
from specd.transport.redis_streams import DEFAULT_REQUEST_STREAM

log = logging.getLogger("specd.verifier")


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class VerifierConfig:
    """Everything `specd verifier` is told, validated on construction."""

    model: str
    redis_url: str
    request_stream: str = DEFAULT_REQUEST_STREAM
    consumer: str = field(default_factory=default_consumer_name)
    drafters: list[str] = field(default_factory=list)  # host:port of drafter services
    grammar: str = ""  # host:port of the grammar service; empty: matchers run in-process
    speculative_algorithm: str | None = None
    speculative_draft_model: str | None = None  # in-process drafting when no drafter is given
    speculative_num_draft_tokens: int = 3  # the most drafts per sequence and step
    speculative_adaptive: bool = True  # k per sequence in [0, that] where it pays (draft_policy.py)
    max_batch_size: int = 128
    session_len: int | None = None
    device: str = "cpu"  # cpu | cuda | cuda:N | auto
    tp: int = 1
    admin_host: str = "0.0.0.0"
    admin_port: int = 50071  # 0: any free port (logged)
    metrics_port: int = 9101  # 0: no metrics endpoint
    block_size: int = 64
    log_interval_s: float = 10.0
    reclaim_idle_ms: int = 30_000  # take over entries idle this long (their verifier died); 0: never
    drafter_deadline_ms: int = 2_000  # a drafter step slower than this is decoded target-only
    drafter_refresh_s: float = 10.0  # re-resolve the drafter names this often (0: only at start)
    tls: TLSConfig = PLAINTEXT  # CA (and client certificate) for the drafter and grammar channels; the
    #                             certificate (and client CA) of the admin port
    async_emit: bool = True  # result round trips overlap the next engine step (a writer thread)
    eager_mode: bool = False  # no CUDA graphs for the target's steps
    enable_prefix_caching: bool = True  # prompts reuse cached blocks of earlier ones (kv_cache.py)

    def __post_init__(self) -> None:
        if self.tp != 1:
            raise ConfigError(f"tp: tensor parallelism (--tp {self.tp}) is not available yet in specd; "
                              "run one verifier per GPU with --tp 1")
        if not self.redis_url:
            raise ConfigError("redis_url: required (redis://host:port/db)")
        if self.drafters and not self.speculative_algorithm:
            raise ConfigError("speculative_algorithm: --drafter needs --speculative-algorithm")
        if self.speculative_algorithm and self.speculative_algorithm not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_algorithm: expected one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {self.speculative_algorithm!r}")
        if not (self.device in ("cpu", "cuda", "auto") or self.device.startswith("cuda:")):
            raise ConfigError(f"device: expected cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.drafter_deadline_ms < 1:
            raise ConfigError(f"drafter_deadline_ms: must be >= 1, got {self.drafter_deadline_ms}")
        if self.drafter_refresh_s < 0:
            raise ConfigError(f"drafter_refresh_s: must be >= 0 (0: off), got {self.drafter_refresh_s}")
        ClaimConfig(idle_ms=self.reclaim_idle_ms)  # validates the reclaim timing
        for name in ("admin_port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name}: must be in [0, 65535], got {getattr(self, name)}")

    def engine_config(self) -> PytorchEngineConfig:
        return PytorchEngineConfig(tp=self.tp, session_len=self.session_len, max_batch_size=self.max_batch_size,
                                   block_size=self.block_size, device_type=self.device.split(":")[0],
                                   eager_mode=self.eager_mode, enable_prefix_caching=self.enable_prefix_caching)

    def speculative_config(self) -> SpeculativeConfig | None:
        if not self.speculative_algorithm or self.speculative_num_draft_tokens == 0:
            return None
        # With remote drafters the draft model lives there; the name only satisfies validation.
        model = self.speculative_draft_model or (",".join(self.drafters) if self.drafters else "")
        return SpeculativeConfig(method=self.speculative_algorithm,
                                 num_speculative_tokens=self.speculative_num_draft_tokens, model=model,
                                 adaptive=self.speculative_adaptive)


class KeyValueFormatter(logging.Formatter):
    """`time level logger message key=value ...`: the `extra` fields of a record, request ids first."""

    _STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = {k: v for k, v in vars(record).items() if k not in self._STANDARD}
        if extras:
            line += " " + " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in extras.items())
        return line


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class _Shutdown:
    """Signal state: the first signal drains, the second stops at once."""

    def __init__(self) -> None:
        self.worker = None
        self.num_signals = 0

    def handle(self, signum, _frame) -> None:
        self.num_signals += 1
        log.info("signal received", extra={"signal": signal.Signals(signum).name,
                                           "count": self.num_signals})
        if self.worker is None:
            return  # still loading: serve() checks num_signals once the model is up
        if self.num_signals == 1:
            self.worker.drain(exit_when_drained=True)
        else:
            self.worker.stop()


GRAMMAR_RECOVER_TIMEOUT_S = 5.0


def build_grammar_backend(config):
    """Matchers on the grammar service when --grammar is given, else in this process."""
    if config.grammar:
        from specd.clients.grammar import RemoteGrammarBackend

        # Recovery (the next replica, or this one back) is waited for this long; past it only the
        # constrained requests fail (503), while every other request of the batch waits with them.
        return RemoteGrammarBackend(config.grammar, credentials=channel_credentials(config.tls),
                                    recover_timeout_s=GRAMMAR_RECOVER_TIMEOUT_S)
    from specd.grammar.compiler import GrammarCompilerCache
    from specd.grammar.local import LocalGrammarBackend

    cache = GrammarCompilerCache.from_model_dir(config.model)
    return LocalGrammarBackend(cache)


def attach_draft_masking(engine, config) -> None:
    """An in-process proposer (no --drafter) masks its drafts here; remote drafters do it themselves."""
    if engine.proposer is None or config.drafters or not hasattr(engine.proposer, "draft_constraints"):
        return
    from specd.grammar.compiler import GrammarCompilerCache
    from specd.proposers.draft_constraints import DraftConstraints

    engine.proposer.draft_constraints = DraftConstraints(lambda: GrammarCompilerCache.from_model_dir(config.model))


def resolve_drafters(addresses: list[str], last: dict[str, list[str]] | None = None) -> list[str]:
    """Expand each host:port whose name resolves to several IPv4 (else IPv6) addresses into one
    address per IP, so that `drafter:50061` under compose `--scale drafter=N`, or a headless
    Kubernetes Service, puts every replica on the hash ring (a gRPC channel to the name would
    stream to just one of them). A name with one address is kept as given. `last` remembers each
    name's expansion across calls (the periodic refresh): a name that does not resolve keeps its
    last addresses, so a DNS hiccup moves no drafter; without one it is kept as given."""
    last = {} if last is None else last
    resolved: list[str] = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, ValueError):
            infos = None
        if infos is None:
            expansion = last.get(address, [address])
        else:
            ips = {family: sorted({info[4][0] for info in infos if info[0] == family})
                   for family in (socket.AF_INET, socket.AF_INET6)}
            ips = ips[socket.AF_INET] or ips[socket.AF_INET6]
            expansion = ([f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips] if len(ips) >= 2
                         else [address])
        if expansion != last.get(address, [address]):  # logged when it changes, not every refresh
            log.info("drafters resolved", extra={"drafter": address, "addresses": ",".join(expansion)})
        last[address] = expansion
        resolved += expansion
    return list(dict.fromkeys(resolved))


def build_proposer(config: VerifierConfig):
    """The remote drafter client when --drafter addresses are given; else None (in-process drafting)."""
    spec = config.speculative_config()
    if not config.drafters or spec is None:
        return None
    try:
        from specd.clients.drafter import RemoteProposer
    except ImportError as e:
        raise ConfigError(f"drafter: the remote proposer is unavailable ({e})") from e
    expansions: dict[str, list[str]] = {}  # shared with the refresh thread, which alone uses it later
    proposer = RemoteProposer(resolve_drafters(config.drafters, expansions),
                              deadline_s=config.drafter_deadline_ms / 1000,
                              credentials=channel_credentials(config.tls),
                              resolve=functools.partial(resolve_drafters, config.drafters, expansions),
                              refresh_s=config.drafter_refresh_s)
    max_k = getattr(proposer, "max_num_draft_tokens", 0) or spec.num_speculative_tokens
    problem = None
    if proposer.method != spec.method:
        problem = (f"speculative_algorithm: the drafters at {config.drafters} run {proposer.method!r}, "
                   f"not {spec.method!r}")
    elif spec.num_speculative_tokens > max_k:
        problem = (f"speculative_num_draft_tokens: {spec.num_speculative_tokens} is more than the drafters "
                   f"propose ({max_k})")
    if problem:
        proposer.shutdown()
        raise ConfigError(problem)
    return proposer


class PortInUseError(ConfigError):
    """A port the verifier serves on could not be bound: most often a second verifier on the host."""

    def __init__(self, flag: str, host: str, port: int) -> None:
        super().__init__(f"--{flag} {port}: cannot bind {host}:{port} (in use: another verifier on this "
                         f"host?); give each verifier its own --{flag}, or 0 for any free port")


def serve(config: VerifierConfig) -> int:
    """Run a verifier until drained by SIGTERM or the Drain RPC; returns the exit code."""
    import redis

    from services.verifier.admin import AdminServer
    from services.verifier.metrics import VerifierMetrics
    from services.verifier.worker import VerifierWorker, WorkerConfig
    from specd.engine.builder import build_engine
    from specd.engine.warm_up import warm_up_engine
    from specd.models.loader import load_tokenizer

    shutdown = _Shutdown()
    signal.signal(signal.SIGTERM, shutdown.handle)
    signal.signal(signal.SIGINT, shutdown.handle)
    worker_config = WorkerConfig(consumer=config.consumer, request_stream=config.request_stream,
                                 log_interval_s=config.log_interval_s,
                                 claims=ClaimConfig(idle_ms=config.reclaim_idle_ms),
                                 async_emit=config.async_emit)
    try:
        admin = AdminServer(config.admin_host, config.admin_port, credentials=server_credentials(config.tls)).start()
    except OSError:
        raise PortInUseError("admin-port", config.admin_host, config.admin_port) from None
    log.info("admin port open", extra={"port": admin.port, "consumer": config.consumer})
    metrics = VerifierMetrics()
    if config.metrics_port:
        try:
            metrics.serve(config.metrics_port)
        except OSError:
            admin.stop()
            raise PortInUseError("metrics-port", "0.0.0.0", config.metrics_port) from None
        log.info("metrics served", extra={"port": config.metrics_port})
    client = proposer = None
    try:
        if config.device.startswith("cuda:"):
            import torch

            torch.cuda.set_device(int(config.device.split(":", 1)[1]))
        tokenizer = load_tokenizer(config.model)
        proposer = build_proposer(config)
        engine = build_engine(config.model, config.engine_config(), config.speculative_config(),
                              tokenizer=tokenizer, proposer=proposer,
                              grammar_backend=build_grammar_backend(config))
        attach_draft_masking(engine, config)
        warm_up_engine(engine)  # graph captures and kernel setup before the first request, not in it
        log.info("model loaded", extra={"model": config.model, "max_batch_size": engine.max_batch_size,
                                        "max_model_len": engine.max_model_len,
                                        "speculative_algorithm": config.speculative_algorithm,
                                        "num_speculative_tokens": engine.num_speculative_tokens})
        # A read timeout bounds a hung Redis (above the XREADGROUP block); errors are retried by the
        # loop with backoff, so Redis may be down at start and come and go while serving.
        client = redis.Redis.from_url(config.redis_url, socket_connect_timeout=5, socket_timeout=10,
                                      socket_keepalive=True)
        worker = VerifierWorker(engine, client, worker_config, metrics)
        try:
            worker.ensure_group()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.error("redis unavailable at start; retrying while serving", extra={"error": str(e)})
        shutdown.worker = worker
        if shutdown.num_signals:
            return 0  # told to stop while loading: nothing admitted yet
        admin.attach(worker)
        worker.run()
        return 0
    finally:
        admin.stop()
        if proposer is not None:
            proposer.shutdown()  # ends the drafter streams: the drafters drop our draft state
        if client is not None:
            client.close()
