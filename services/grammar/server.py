"""The grammar process: one model's tokenizer, a grammar compiler cache, served over gRPC.

No weights are loaded: the model contributes its tokenizer, config.json's vocab_size (the width of
the masks: the lm_head rows, which may exceed the tokenizer's vocabulary) and its eos ids (the
tokens allowed once a grammar is complete). Grammar + grpc.health.v1 + reflection share one port.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from services.common.grpc_server import RunningServer, serve_until_signal, start_grpc_server
from services.common.tls import PLAINTEXT, TLSConfig
from services.grammar.servicer import GrammarServicer
from specd.v1 import grammar_pb2, grammar_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50081
GRAMMAR_SERVICE = grammar_pb2.DESCRIPTOR.services_by_name["Grammar"].full_name


def load_grammar(model_path: str | Path, *, cache_entries: int = 256,
                 max_threads: int | None = None) -> GrammarServicer:
    """A servicer over a GrammarCompilerCache for the model's tokenizer and vocabulary."""
    from specd.grammar.compiler import GrammarCompilerCache
    from specd.models.model_path import resolve_model_path

    cache = GrammarCompilerCache.from_model_dir(resolve_model_path(str(model_path)),
                                                max_entries=cache_entries, max_threads=max_threads)
    return GrammarServicer(cache)


GrammarServer = RunningServer  # the name tests and callers use


def start_server(servicer: GrammarServicer, host: str = "0.0.0.0", port: int = 0,
                 max_workers: int = 32, tls: TLSConfig = PLAINTEXT) -> RunningServer:
    """Start serving `servicer` (port 0: any free port; TLS when `tls` has a certificate); health turns
    SERVING once started."""
    return start_grpc_server(servicer, grammar_pb2_grpc.add_GrammarServicer_to_server, GRAMMAR_SERVICE,
                             host=host, port=port, max_workers=max_workers, name="grammar", tls=tls)


def serve_grammar(model_path: str | Path, host: str = "0.0.0.0", port: int = DEFAULT_PORT, *,
                  cache_entries: int = 256, max_workers: int = 32, grace_s: float = 5.0,
                  tls: TLSConfig = PLAINTEXT) -> None:
    """Load, serve until SIGTERM or SIGINT, then stop gracefully (blocks; call from the main thread)."""
    t0 = time.perf_counter()
    servicer = load_grammar(model_path, cache_entries=cache_entries)
    running = start_server(servicer, host, port, max_workers, tls)
    cache = servicer.compiler_cache
    logger.info("event=grammar_serving model=%s host=%s port=%d vocab_size=%d eos_token_ids=%s "
                "cache_entries=%d load_s=%.2f", model_path, host, running.port, cache.vocab_size,
                cache.eos_token_ids, cache.max_entries, time.perf_counter() - t0)
    serve_until_signal(running, logger, "grammar", grace_s)
