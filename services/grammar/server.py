"""The grammar process: one model's tokenizer, a grammar compiler cache, served over gRPC.

No weights are loaded: the model contributes its tokenizer, config.json's vocab_size (the width of
the masks: the lm_head rows, which may exceed the tokenizer's vocabulary) and its eos ids (the
tokens allowed once a grammar is complete). Grammar + grpc.health.v1 + reflection share one port.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.grammar.servicer import GrammarServicer
from specd.v1 import grammar_pb2, grammar_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50081
MAX_MESSAGE_BYTES = 256 << 20  # a step's masks: batch x (k + 1) rows of vocab / 8 bytes
GRAMMAR_SERVICE = grammar_pb2.DESCRIPTOR.services_by_name["Grammar"].full_name
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def load_grammar(model_path: str | Path, *, cache_entries: int = 256,
                 max_threads: int | None = None) -> GrammarServicer:
    """A servicer over a GrammarCompilerCache for the model's tokenizer and vocabulary."""
    from specd.grammar.compiler import GrammarCompilerCache
    from specd.models.model_path import resolve_model_path

    cache = GrammarCompilerCache.from_model_dir(resolve_model_path(str(model_path)),
                                                max_entries=cache_entries, max_threads=max_threads)
    return GrammarServicer(cache)


@dataclass
class GrammarServer:
    """A running grammar gRPC server (Grammar + grpc.health.v1 + reflection on one port)."""

    server: grpc.Server
    servicer: GrammarServicer
    health: health.HealthServicer
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, grace_s: float | None = 5.0) -> None:
        """Report NOT_SERVING, then let in-flight steps finish for up to grace_s seconds."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def start_server(servicer: GrammarServicer, host: str = "0.0.0.0", port: int = 0,
                 max_workers: int = 32) -> GrammarServer:
    """Start serving `servicer` (port 0: any free port); health turns SERVING once started.

    Sync gRPC holds one worker thread per open Steps stream, so max_workers bounds the number of
    verifiers served at once (plus a few for Validate and health).
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar"),
                         options=GRPC_OPTIONS)
    grammar_pb2_grpc.add_GrammarServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((GRAMMAR_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                        server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"grammar: cannot listen on {host}:{port}")
    server.start()
    for service in ("", GRAMMAR_SERVICE):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return GrammarServer(server, servicer, health_servicer, bound)


def serve_grammar(model_path: str | Path, host: str = "0.0.0.0", port: int = DEFAULT_PORT, *,
                  cache_entries: int = 256, max_workers: int = 32, grace_s: float = 5.0) -> None:
    """Load, serve until SIGTERM or SIGINT, then stop gracefully (blocks; call from the main thread)."""
    t0 = time.perf_counter()
    servicer = load_grammar(model_path, cache_entries=cache_entries)
    running = start_server(servicer, host, port, max_workers)
    cache = servicer.compiler_cache
    logger.info("event=grammar_serving model=%s host=%s port=%d vocab_size=%d eos_token_ids=%s "
                "cache_entries=%d load_s=%.2f", model_path, host, running.port, cache.vocab_size,
                cache.eos_token_ids, cache.max_entries, time.perf_counter() - t0)
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        logger.info("event=grammar_stopping signal=%s", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        running.stop(grace_s)
        for s, handler in previous.items():
            signal.signal(s, handler)
        logger.info("event=grammar_stopped port=%d", running.port)
