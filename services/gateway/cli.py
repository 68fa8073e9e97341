"""`specd gateway MODEL ...`: the flags; nothing heavy is imported until the command runs."""

from __future__ import annotations

import argparse

from services.common.tls import TLSConfig, add_tls_arguments
from services.gateway.reasoning import FORMATS as REASONING_FORMATS
from services.gateway.tool_formats import FORMATS as TOOL_CALL_FORMATS
from specd.host_threads import add_threads_argument


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("gateway", help="serve the OpenAI-compatible HTTP API and specd.v1.Generate (gRPC)",
                       description="Validate and tokenize requests, queue them in Redis for the verifiers, "
                                   "and relay their results.")
    p.add_argument("model", help="checkpoint directory or cached Hub id (its tokenizer and config.json)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                   help="redis://[:PASSWORD@]HOST:PORT/DB, or rediss://... for TLS (certificate options as "
                        "query parameters, e.g. ?ssl_ca_certs=/path/ca.pem)")
    p.add_argument("--request-stream", default="specd:requests", help="Redis stream the verifiers read")
    p.add_argument("--served-model-name", default="", help="model name in the API (default: MODEL as given)")
    p.add_argument("--max-queue-depth", type=int, default=1024,
                   help="answer 429 while the request stream holds this many requests (0: no limit)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds from receipt to the last token before a 504 (gRPC: the client's deadline "
                        "when shorter)")
    p.add_argument("--max-request-bytes", type=int, default=16 << 20,
                   help="largest HTTP body (413 past it) and gRPC message (RESOURCE_EXHAUSTED)")
    p.add_argument("--api-keys", nargs="*", default=None,
                   help="accepted API keys (Authorization: Bearer KEY); 401 / UNAUTHENTICATED without one. "
                        "Default: the comma-separated SPECD_API_KEYS environment variable; none: open")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: config.json's max_position_embeddings)")
    p.add_argument("--grammar", default="", help="grammar service host:port that validates response_format "
                   "(default: compile in the gateway)")
    p.add_argument("--tool-call-parser", default="", choices=["", *TOOL_CALL_FORMATS],
                   help="how the model writes tool calls (default: recognised from its chat template)")
    p.add_argument("--reasoning-parser", default="", choices=["", *REASONING_FORMATS],
                   help="split a reasoning model's thinking into reasoning_content (default: none)")
    p.add_argument("--ssl", action="store_true",
                   help="serve HTTPS on the HTTP port with the --tls-cert-file / --tls-key-file certificate")
    p.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics on GET /metrics")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds requests in flight may take to finish after SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_threads_argument(p)
    add_tls_arguments(p)
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    import logging

    from services.common.api_keys import keys_from_env, parse_keys
    from services.gateway.core import GatewayConfig
    from services.gateway.server import run
    from specd.host_threads import size_threads

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    size_threads("gateway", "cpu", args.threads)
    config = GatewayConfig(model=args.model, served_model_name=args.served_model_name, redis_url=args.redis_url,
                           request_stream=args.request_stream, max_queue_depth=args.max_queue_depth,
                           request_timeout=args.request_timeout, enable_metrics=args.enable_metrics,
                           max_model_len=args.max_model_len, grammar=args.grammar,
                           tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                           ssl=args.ssl,
                           max_request_bytes=args.max_request_bytes, tls=TLSConfig.from_args(args),
                           api_keys=tuple(parse_keys(args.api_keys) if args.api_keys is not None else keys_from_env()))
    run(config, host=args.host, port=args.port, grpc_port=args.grpc_port, grace_s=args.shutdown_grace,
        log_level=args.log_level)
    return 0
