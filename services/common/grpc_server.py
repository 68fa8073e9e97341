"""A sync gRPC server with grpc.health.v1 and reflection on one port, and the SIGTERM wait loop.

The drafter and the grammar service are both "one servicer over a core object, long-lived
streams, health and reflection"; this is that shape once.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.tls import PLAINTEXT, TLSConfig, add_port

MAX_MESSAGE_BYTES = 256 << 20  # EAGLE-3 hidden rows or grammar masks of a large batch: several MB
# so_reuseport off: gRPC turns it on by default on Linux, and then a second server told the same
# port binds it too and silently takes half the connections (a drafter answering gateway calls
# with UNIMPLEMENTED); off, the second one fails at start with a bind error.
NO_PORT_SHARING = ("grpc.so_reuseport", 0)
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), NO_PORT_SHARING]


@dataclass
class RunningServer:
    """A started server: its servicer, its health servicer and the port it bound."""

    server: grpc.Server
    servicer: Any
    health: health.HealthServicer
    port: int
    also_stop: list[Callable[[], None]] = field(default_factory=list)  # after the gRPC server (its grace first)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, grace_s: float | None = 5.0) -> None:
        """Report NOT_SERVING, then let in-flight steps finish for up to grace_s seconds."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        for stop in self.also_stop:
            stop()


def start_grpc_server(servicer: Any, add_to_server: Callable[[Any, grpc.Server], None], service_name: str,
                      *, host: str, port: int, max_workers: int, name: str,
                      tls: TLSConfig = PLAINTEXT) -> RunningServer:
    """Serve `servicer` (port 0: any free port), over TLS when `tls` has a certificate; health turns
    SERVING once started.

    Sync gRPC holds one worker thread per open stream, so max_workers bounds the number of
    verifiers served at once (plus a few for unary calls and health).
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
                         options=GRPC_OPTIONS)
    add_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = add_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise OSError(f"{name}: cannot listen on {host}:{port}")
    server.start()
    for service in ("", service_name):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, servicer, health_servicer, bound)


def serve_until_signal(running: RunningServer, logger: logging.Logger, name: str, grace_s: float) -> None:
    """Block until SIGTERM or SIGINT, then stop gracefully (call from the main thread)."""
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        logger.info("event=%s_stopping signal=%s", name, signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        running.stop(grace_s)
        for s, handler in previous.items():
            signal.signal(s, handler)
        logger.info("event=%s_stopped port=%d", name, running.port)
