"""The `specd` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _make_tiny_models(args: argparse.Namespace) -> int:
    from specd.tiny_models.make import make_tiny_models

    for name, path in make_tiny_models(args.dir, seed=args.seed).items():
        print(f"{name}: {path}")
    return 0


def _install_default_models(args: argparse.Namespace) -> int:
    from specd.default_models import install_default_models

    copied = install_default_models(args.dir, args.source)
    print(f"copied {len(copied)} entries into {args.dir}" if copied else
          f"{args.dir} already holds the default models")
    return 0


def _generate(args: argparse.Namespace) -> int:
    """Run the in-process pipeline on prompts and print completions with speculation figures."""
    from specd import GenerationConfig, PytorchEngineConfig, pipeline
    from specd.messages import SpeculativeConfig

    spec = None
    if args.speculative_algorithm:
        spec = SpeculativeConfig(method=args.speculative_algorithm,
                                 num_speculative_tokens=args.speculative_num_draft_tokens,
                                 model=args.speculative_draft_model or "",
                                 adaptive=args.speculative_adaptive)
    pipe = pipeline(args.model, backend_config=PytorchEngineConfig(max_batch_size=args.max_batch_size),
                    speculative_config=spec)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                           temperature=args.temperature, random_seed=args.seed)
    responses = pipe(args.prompt or ["def fibonacci(n):", "import json"], gen_config=gen,
                     do_preprocess=not args.raw)
    for r in responses:
        print(json.dumps({"text": r.text, "generate_token_len": r.generate_token_len,
                          "finish_reason": r.finish_reason,
                          "spec_stats": r.spec_stats.to_dict() if r.spec_stats else None}))
    return 0


SERVICE_CLI_MODULES = ("services.gateway.cli", "services.verifier.cli", "services.drafter.cli",
                       "services.launcher.cli", "services.grammar.cli", "specd.train.cli")


def _healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when the target is healthy (compose and Kubernetes probes call this)."""
    if args.kind == "http":
        import urllib.request

        try:
            with urllib.request.urlopen(args.target, timeout=args.timeout) as reply:
                return 0 if reply.status == 200 else 1
        except OSError as e:
            print(f"unhealthy: {e}", file=sys.stderr)
            return 1
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.tls import TLSConfig, open_channel

    with open_channel(args.target, TLSConfig.from_args(args)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"unhealthy: {e.code().name}", file=sys.stderr)
            return 1
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="Speculative-decoding LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-models", help="write tiny checkpoints in every supported layout")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_models)

    install = sub.add_parser("install-default-models",
                             help="copy the trained default models (models/ of specd) into DIR")
    install.add_argument("dir", type=Path)
    install.add_argument("--source", type=Path, default=None,
                         help="where the family is (default: SPECD_DEFAULT_MODELS, else models/ beside the "
                              "package, else /opt/specd/models)")
    install.set_defaults(func=_install_default_models)

    gen = sub.add_parser("generate", help="run prompts through the in-process pipeline")
    gen.add_argument("model")
    gen.add_argument("--prompt", action="append", help="repeat for several prompts")
    gen.add_argument("--speculative-algorithm",
                     choices=["eagle3", "deepseek_mtp", "qwen3_5_mtp", "draft_model", "ngram"])
    gen.add_argument("--speculative-draft-model")
    gen.add_argument("--speculative-num-draft-tokens", type=int, default=3,
                     help="the most drafts per sequence and step")
    gen.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=True,
                     help="pick each sequence's draft length per step where it pays (--no-...: the maximum)")
    gen.add_argument("--max-batch-size", type=int, default=32)
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.set_defaults(func=_generate)

    health = sub.add_parser("healthcheck", help="probe a specd service (exit 0 when healthy)")
    health.add_argument("kind", choices=["grpc", "http"])
    health.add_argument("target", help="host:port (grpc) or URL (http)")
    health.add_argument("--service", default="", help="grpc health service name")
    health.add_argument("--timeout", type=float, default=3.0)
    from services.common.tls import add_tls_arguments

    add_tls_arguments(health, server=False)  # probing a TLS service: its CA (and a client cert)
    health.set_defaults(func=_healthcheck)

    # Each service owns its flags; its cli module imports nothing heavy at module level.
    import importlib

    for module in SERVICE_CLI_MODULES:
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # config and model-path errors: a message, no traceback
        print(f"specd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
