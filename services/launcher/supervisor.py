"""Run a whole specd stack on one machine: Redis (embedded unless a URL is given), drafter,
grammar service, verifier and gateway as separate OS processes, started in dependency order and stopped together.

If any child exits, the others are stopped and the supervisor exits non-zero: a half-running
stack would accept requests that nobody serves.

Access settings reach the children this way: API keys through the gateway's environment
(SPECD_API_KEYS, so they stay out of `ps`), one TLS identity for every gRPC hop (each server
presents the certificate, each client verifies it against the CA), the Redis URL with its password
as given.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from services.common.tls import PLAINTEXT, TLSConfig

log = logging.getLogger("specd.serve")


@dataclass
class StackConfig:
    """What `specd serve api_server` starts."""

    model: str
    server_name: str = "0.0.0.0"
    server_port: int = 23333
    grpc_port: int = 0  # 0: server_port + 1
    redis_url: str | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model: str | None = None
    speculative_num_draft_tokens: int = 3
    speculative_adaptive: bool = True  # the verifier picks k per sequence and step (False: the maximum)
    max_batch_size: int = 128
    session_len: int | None = None
    tp: int = 1
    enable_metrics: bool = False
    served_model_name: str | None = None
    tool_call_parser: str = ""  # the gateway's --tool-call-parser ("": from the chat template)
    ssl: bool = False  # HTTPS on server_port, with tls's certificate
    reasoning_parser: str = ""  # the gateway's --reasoning-parser ("": none)
    device: str = "cpu"
    drafter_device: str | None = None
    eager_mode: bool = False  # no CUDA graphs, in the verifier and the drafter
    enable_prefix_caching: bool = True  # the verifier's (--no-enable-prefix-caching turns it off)
    drafter_port: int = 0
    verifier_admin_port: int = 0
    verifier_metrics_port: int = 0  # the verifier's step metrics, with enable_metrics (0: a free port, logged)
    max_queue_depth: int = 1024
    api_keys: tuple[str, ...] = ()  # the gateway's Bearer keys; empty: open
    request_timeout: float = 600.0
    max_request_bytes: int = 16 << 20
    tls: TLSConfig = PLAINTEXT  # gRPC between the services (and the gateway's public gRPC API)
    log_level: str = "info"
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tp != 1:
            raise ValueError("tp: tensor parallelism (--tp > 1) is not available yet in specd; use --tp 1")
        if self.speculative_algorithm in ("eagle3", "draft_model") and not self.speculative_draft_model:
            raise ValueError(f"speculative_draft_model: --speculative-algorithm {self.speculative_algorithm} "
                             "needs --speculative-draft-model")
        if self.speculative_num_draft_tokens < 0:
            raise ValueError("speculative_num_draft_tokens: must be >= 0")
        if self.ssl and not self.tls.serves_tls:
            raise ValueError("ssl: HTTPS needs the certificate of --tls-cert-file and --tls-key-file")
        if self.tls.serves_tls != self.tls.connects_tls:
            raise ValueError("tls: the stack's services talk to each other, so give --tls-cert-file and "
                             "--tls-key-file together with --tls-ca-file (the CA that signed them)")


# The drafter's KV-cache share of the free GPU memory when it shares the verifier's GPU. The drafter
# loads first and would take 80% as it does alone (PytorchEngineConfig.cache_max_entry_count),
# leaving the verifier's activations too little: a draft_model stack on one H100 gave its drafter
# 20 GB and the verifier ran out of memory in a batch-128 prefill. A tenth of an 80 GB card
# holds ~500k tokens of a 4-layer draft model, beyond the ~250k tokens the 8B target's own cache
# holds beside it; a draft cache that fills costs drafts, not requests (draft_model.py).
SHARED_GPU_DRAFTER_CACHE_FRACTION = 0.1


def shares_a_gpu(device: str, other: str) -> bool:
    """Whether two torch device names are the same CUDA device ("cuda" is "cuda:0")."""
    def index(name: str) -> int | None:
        if name == "cuda":
            return 0
        return int(name.split(":", 1)[1]) if name.startswith("cuda:") else None
    return index(device) is not None and index(device) == index(other)


def _free_port() -> int:
    from specd.transport.ports import free_port

    return free_port()


class Stack:
    """The child processes of one stack, in start order."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.redis = None
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.redis_url = config.redis_url
        self.grpc_port = config.grpc_port or config.server_port + 1
        self.verifier_metrics_port = 0  # where the verifier serves its step metrics (enable_metrics)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "specd.cli", *args, "--log-level", self.config.log_level.lower()]
        log.info("starting %s: %s", name, " ".join(cmd))
        proc = subprocess.Popen(cmd, env={**os.environ, **self.config.extra_env, **(env or {})},
                                start_new_session=True)
        self.children.append((name, proc))
        return proc

    def _verifier_metrics_port(self) -> int:
        """The verifier's --metrics-port: the gateway's /metrics holds the requests' figures, the
        verifier's the steps' (draft / verify split, batch size, draft lengths)."""
        c = self.config
        if c.enable_metrics:
            self.verifier_metrics_port = c.verifier_metrics_port or _free_port()
        return self.verifier_metrics_port

    def start(self, timeout: float = 300.0) -> None:
        c = self.config
        if not self.redis_url:
            from specd.transport.embedded_redis import start_embedded_redis

            self.redis = start_embedded_redis()
            self.redis_url = self.redis.url
            log.info("embedded redis at %s", self.redis_url)
        drafter_addr = None
        if c.speculative_algorithm and c.speculative_num_draft_tokens > 0:
            port = c.drafter_port or _free_port()
            args = ["drafter", c.model, "--speculative-algorithm", c.speculative_algorithm,
                    "--host", "127.0.0.1", "--port", str(port), "--device", c.drafter_device or c.device]
            if c.speculative_draft_model:
                args += ["--speculative-draft-model", c.speculative_draft_model]
            if shares_a_gpu(c.drafter_device or c.device, c.device):
                args += ["--cache-max-entry-count", str(SHARED_GPU_DRAFTER_CACHE_FRACTION)]
            if c.eager_mode:
                args += ["--eager-mode"]
            self._spawn("drafter", args + self._server_tls_flags())
            drafter_addr = f"127.0.0.1:{port}"
        grammar_addr = f"127.0.0.1:{_free_port()}"
        self._spawn("grammar", ["grammar", c.model, "--host", "127.0.0.1", "--port", grammar_addr.split(":")[1],
                                *self._server_tls_flags()])
        # Drafter and grammar service load side by side; the verifier needs both.
        if drafter_addr:
            self._wait_grpc_health(drafter_addr, timeout)
        self._wait_grpc_health(grammar_addr, timeout)
        admin_port = c.verifier_admin_port or _free_port()
        args = ["verifier", c.model, "--redis-url", self.redis_url, "--max-batch-size", str(c.max_batch_size),
                "--device", c.device, "--admin-port", str(admin_port),
                "--metrics-port", str(self._verifier_metrics_port()),
                "--grammar", grammar_addr]
        if c.session_len:
            args += ["--session-len", str(c.session_len)]
        if not c.enable_prefix_caching:
            args += ["--no-enable-prefix-caching"]
        if c.eager_mode:
            args += ["--eager-mode"]
        if drafter_addr:
            args += ["--drafter", drafter_addr, "--speculative-algorithm", c.speculative_algorithm,
                     "--speculative-num-draft-tokens", str(c.speculative_num_draft_tokens)]
            if not c.speculative_adaptive:
                args.append("--no-speculative-adaptive")
        self._spawn("verifier", args + c.tls.to_flags())
        self._wait_grpc_health(f"127.0.0.1:{admin_port}", timeout)
        args = ["gateway", c.model, "--host", c.server_name, "--port", str(c.server_port),
                "--grpc-port", str(self.grpc_port), "--redis-url", self.redis_url,
                "--max-queue-depth", str(c.max_queue_depth), "--grammar", grammar_addr]
        if c.served_model_name:
            args += ["--served-model-name", c.served_model_name]
        if c.tool_call_parser:
            args += ["--tool-call-parser", c.tool_call_parser]
        if c.ssl:
            args.append("--ssl")
        if c.reasoning_parser:
            args += ["--reasoning-parser", c.reasoning_parser]
        if c.session_len:  # the gateway refuses what the verifier's context could not hold
            args += ["--max-model-len", str(c.session_len)]
        if c.enable_metrics:
            args.append("--enable-metrics")
        args += ["--request-timeout", str(c.request_timeout), "--max-request-bytes", str(c.max_request_bytes),
                 *c.tls.to_flags()]
        from specd import settings

        self._spawn("gateway", args, env={settings.API_KEYS.name: ",".join(c.api_keys)})
        scheme = "https" if c.ssl else "http"
        self._wait_http_health(f"{scheme}://127.0.0.1:{c.server_port}/health", timeout)
        log.info("specd is serving on %s://%s:%d (gRPC :%d)", scheme, c.server_name, c.server_port, self.grpc_port)
        if self.verifier_metrics_port:
            log.info("the verifier's step metrics: http://127.0.0.1:%d/metrics", self.verifier_metrics_port)

    def _server_tls_flags(self) -> list[str]:
        tls = self.config.tls
        return TLSConfig(cert_file=tls.cert_file, key_file=tls.key_file, client_ca_file=tls.client_ca_file).to_flags()

    def _check_children(self) -> None:
        for name, proc in self.children:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}")

    def _wait_grpc_health(self, address: str, timeout: float, tls: TLSConfig | None = None) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from services.common.tls import open_channel

        deadline = time.monotonic() + timeout
        with open_channel(address, self.config.tls if tls is None else tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_children()
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{address} did not become healthy in {timeout:.0f} s")
                time.sleep(0.2)

    def _wait_http_health(self, url: str, timeout: float) -> None:
        import ssl
        import urllib.request

        # HTTPS: the gateway's certificate is checked against the stack's CA, as the services' are.
        context = ssl.create_default_context(cafile=self.config.tls.ca_file) if url.startswith("https") else None
        deadline = time.monotonic() + timeout
        while True:
            self._check_children()
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer in {timeout:.0f} s")
            time.sleep(0.2)

    def wait(self) -> int:
        """Block until a child exits (returns its code) or a signal arrives."""
        while True:
            for name, proc in self.children:
                if proc.poll() is not None:
                    log.error("%s exited with code %s; stopping the stack", name, proc.returncode)
                    return proc.returncode or 1
            time.sleep(0.5)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the children in reverse start order (gateway first: no new requests), then Redis."""
        for name, proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", name, timeout)
                    proc.kill()
                    proc.wait()
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def run_stack(config: StackConfig) -> int:
    """Start the stack, serve until Ctrl-C / SIGTERM or a child's death, stop everything."""
    stack = Stack(config)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # Also SIGINT, explicitly: a process that starts with SIGINT ignored (`specd serve ... &` in a
    # script: bash ignores it in background jobs) gets no KeyboardInterrupt from Python, and
    # scripts/demo.sh's Ctrl-C trap waited forever on a stack that never heard it.
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start()
        return stack.wait()
    except KeyboardInterrupt:
        log.info("stopping")
        return 0
    except (RuntimeError, TimeoutError) as e:
        log.error("%s", e)
        return 1
    finally:
        stack.stop()
