"""Runs the gateway: uvicorn (HTTP) and a grpc.aio server in one asyncio loop, sharing one Gateway.

SIGTERM (or SIGINT) starts a graceful shutdown: both servers stop accepting, requests in flight
get `grace_s` seconds to finish (their results keep flowing through the result reader), then the
reader and the Redis connections close. Accepted requests live on in Redis (docs/design.md): verifiers
finish them and their results expire; clients reconnect to another gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading

import uvicorn

from services.gateway.app import create_app
from services.gateway.core import Gateway, GatewayConfig
from services.gateway.grpc_api import build_grpc_server

logger = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: GatewayServer owns shutdown for both servers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class GatewayServer:
    """One gateway process's servers. `serve()` runs until `shutdown()` or a signal."""

    def __init__(self, config: GatewayConfig, *, host: str = "0.0.0.0", port: int = 8000,
                 grpc_port: int = 50051, grace_s: float = 10.0, access_log: bool = True,
                 log_level: str = "info", gateway: Gateway | None = None) -> None:
        self.config = config
        self.host = host
        self.port = port
        self.grpc_port = grpc_port
        self.grace_s = grace_s
        self.access_log = access_log
        self.log_level = log_level
        self.gateway = gateway
        self.ready = threading.Event()  # set once both servers accept (ports bound)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def shutdown(self) -> None:
        """Begin a graceful shutdown; safe from any thread or a signal handler."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def serve(self, *, install_signal_handlers: bool = True) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        gateway = self.gateway = self.gateway or Gateway(self.config)
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        await gateway.start()
        try:
            await self._serve_both(gateway)
        finally:
            await gateway.close()
            if install_signal_handlers:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self._loop.remove_signal_handler(sig)

    async def _serve_both(self, gateway: Gateway) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        tls = self.config.tls if self.config.ssl else None
        http = _Uvicorn(uvicorn.Config(create_app(gateway), host=self.host, port=self.port, lifespan="off",
                                       access_log=self.access_log, log_level=self.log_level,
                                       timeout_graceful_shutdown=max(1, int(self.grace_s)),
                                       ssl_certfile=tls and tls.cert_file, ssl_keyfile=tls and tls.key_file))
        grpc_server, self.grpc_port, health_servicer = await build_grpc_server(gateway, self.host, self.grpc_port)
        http_task = asyncio.create_task(http.serve(sockets=[sock]), name="specd-gateway-http")
        try:
            while not http.started and not http_task.done():
                await asyncio.sleep(0.01)
            if http_task.done():
                http_task.result()  # startup failed: raise its error
            logger.info("gateway for %s: %s on %s:%d, gRPC on %s:%d, requests to %s", gateway.model_name,
                        "HTTPS" if tls else "HTTP", self.host, self.port, self.host, self.grpc_port,
                        self.config.request_stream)
            self.ready.set()
            stop_wait = asyncio.create_task(self._stop.wait())
            await asyncio.wait({http_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
        finally:
            # Both servers stop accepting; requests in flight get the grace period (the reader still runs).
            logger.info("gateway shutting down (grace %.0f s)", self.grace_s)
            await health_servicer.enter_graceful_shutdown()
            http.should_exit = True
            await asyncio.gather(grpc_server.stop(self.grace_s), http_task, return_exceptions=True)
            sock.close()

    def _on_signal(self, sig: int) -> None:
        logger.info("received %s", signal.Signals(sig).name)
        self._stop.set()


def run(config: GatewayConfig, **kwargs) -> None:
    """Serve until SIGTERM/SIGINT (the `specd gateway` command)."""
    asyncio.run(GatewayServer(config, **kwargs).serve())
