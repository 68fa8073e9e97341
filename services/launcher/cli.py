"""`specd serve api_server MODEL ...`: lmdeploy's command line, running specd's whole stack."""

from __future__ import annotations

import argparse
import logging

from services.common.tls import TLSConfig, add_tls_arguments
from services.gateway.reasoning import FORMATS as REASONING_FORMATS
from services.gateway.tool_formats import FORMATS as TOOL_CALL_FORMATS

METHODS = ["eagle3", "deepseek_mtp", "qwen3_5_mtp", "draft_model", "ngram"]


def add_parser(sub) -> None:
    serve = sub.add_parser("serve", help="run a whole stack (redis, drafter, verifier, gateway)")
    kinds = serve.add_subparsers(dest="serve_kind", required=True)
    api = kinds.add_parser("api_server", help="OpenAI-compatible server with speculative decoding")
    api.add_argument("model", help="local model directory (config.json + safetensors)")
    api.add_argument("--server-name", default="0.0.0.0")
    api.add_argument("--server-port", type=int, default=23333)
    api.add_argument("--grpc-port", type=int, default=0, help="default: server port + 1")
    api.add_argument("--backend", choices=["pytorch"], default="pytorch",
                     help="accepted for lmdeploy compatibility; specd has one backend")
    api.add_argument("--redis-url", default=None,
                     help="redis://[:PASSWORD@]HOST:PORT/DB or rediss://... (TLS); default: start an embedded "
                          "redis-server")
    api.add_argument("--speculative-algorithm", choices=METHODS, default=None)
    api.add_argument("--speculative-draft-model", default=None)
    api.add_argument("--speculative-num-draft-tokens", type=int, default=3,
                     help="the most drafts per sequence and step (adaptive: each step picks 0 to this)")
    api.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=True,
                     help="pick each sequence's draft length per step where it pays "
                          "(--no-speculative-adaptive: the maximum every step)")
    api.add_argument("--max-batch-size", type=int, default=128)
    api.add_argument("--session-len", type=int, default=None)
    api.add_argument("--tp", type=int, default=1)
    api.add_argument("--enable-metrics", action="store_true",
                     help="Prometheus /metrics on the server port (requests) and on the verifier's "
                          "--verifier-metrics-port (its steps)")
    api.add_argument("--verifier-metrics-port", type=int, default=0,
                     help="with --enable-metrics: where the verifier serves its step metrics (0: a free port, logged)")
    api.add_argument("--model-name", dest="served_model_name", default=None)
    api.add_argument("--ssl", action="store_true",
                     help="HTTPS on the server port, with the --tls-cert-file / --tls-key-file certificate (as lmdeploy's)")
    api.add_argument("--reasoning-parser", default="", choices=["", *REASONING_FORMATS],
                     help="split a reasoning model's thinking into reasoning_content (default: none)")
    api.add_argument("--tool-call-parser", default="", choices=["", *TOOL_CALL_FORMATS],
                     help="how the model writes tool calls (default: recognised from its chat template)")
    api.add_argument("--device", default="cpu", help="verifier device: cpu | cuda | cuda:N")
    api.add_argument("--drafter-device", default=None, help="default: the verifier's device")
    api.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="prompts reuse the cached K/V blocks of earlier ones (on by default)")
    api.add_argument("--eager-mode", action="store_true",
                     help="no CUDA graphs (the verifier's steps and the drafter's), as lmdeploy's flag")
    api.add_argument("--max-queue-depth", type=int, default=1024,
                     help="429 while this many requests are queued or running")
    api.add_argument("--api-keys", type=str, nargs="*", default=None,
                     help="optional list of space-separated API keys (Authorization: Bearer KEY), as lmdeploy")
    api.add_argument("--request-timeout", type=float, default=600.0,
                     help="seconds a request may take before the client gets a timeout error")
    api.add_argument("--max-request-bytes", type=int, default=16 << 20, help="largest request body")
    api.add_argument("--log-level", default="info", type=str.lower,
                     choices=["debug", "info", "warning", "error"])
    add_tls_arguments(api)
    api.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from services.common.api_keys import parse_keys
    from services.launcher.supervisor import StackConfig, run_stack

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = StackConfig(
        model=args.model, server_name=args.server_name, server_port=args.server_port,
        grpc_port=args.grpc_port, redis_url=args.redis_url,
        speculative_algorithm=args.speculative_algorithm,
        speculative_draft_model=args.speculative_draft_model,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        speculative_adaptive=args.speculative_adaptive,
        max_batch_size=args.max_batch_size, session_len=args.session_len, tp=args.tp,
        enable_metrics=args.enable_metrics, verifier_metrics_port=args.verifier_metrics_port,
        served_model_name=args.served_model_name, tool_call_parser=args.tool_call_parser, ssl=args.ssl,
        reasoning_parser=args.reasoning_parser,
        device=args.device, drafter_device=args.drafter_device, eager_mode=args.eager_mode,
        enable_prefix_caching=args.enable_prefix_caching,
        max_queue_depth=args.max_queue_depth,
        api_keys=tuple(parse_keys(args.api_keys)), request_timeout=args.request_timeout,
        max_request_bytes=args.max_request_bytes, tls=TLSConfig.from_args(args), log_level=args.log_level)
    return run_stack(config)
