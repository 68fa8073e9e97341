"""`specd verifier MODEL ...`: the flags of the verifier service (nothing heavy imported here)."""

from __future__ import annotations

import argparse
import os
import sys

from services.common.tls import TLSConfig, add_tls_arguments  # no grpc import: cheap
from specd import settings
from specd.host_threads import add_threads_argument
from specd.messages import SPECULATIVE_METHODS  # dataclasses only: cheap to import


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("verifier", help="run a verifier: the target model behind a Redis request stream")
    p.add_argument("model", help="target checkpoint (local path or a cached hub id)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--request-stream", default="specd:requests")
    p.add_argument("--consumer", default=None, help="name in the consumer group (default: hostname-pid)")
    p.add_argument("--drafter", default="", help="drafter service address(es), host:port[,host:port...]")
    p.add_argument("--grammar", default="", help="grammar service address(es) host:port[,host:port...], "
                                                 "replicas tried in turn when one fails (default: in-process)")
    p.add_argument("--speculative-algorithm", choices=SPECULATIVE_METHODS, default=None)
    p.add_argument("--speculative-draft-model", default=None,
                   help="draft checkpoint for in-process drafting (without --drafter)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=3,
                   help="the most drafts per sequence and step (adaptive: each step picks 0 to this)")
    p.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="pick each sequence's draft length per step from its acceptance and the "
                        "measured step costs, 0 where drafting does not pay (--no-speculative-adaptive: "
                        "the maximum every step)")
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--session-len", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--admin-host", default="0.0.0.0")
    p.add_argument("--admin-port", type=int, default=50071, help="gRPC admin + health (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=9101, help="Prometheus /metrics (0: off)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism (only 1 for now)")
    p.add_argument("--eager-mode", action="store_true", help="no CUDA graphs for the target's steps")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="prompts reuse the cached K/V blocks of earlier ones (lmdeploy's flag; on by default; "
                        "engines whose drafter needs the target's hidden states prefill in full)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per KV-cache block")
    p.add_argument("--reclaim-idle-ms", type=int, default=30_000,
                   help="take over requests whose verifier has not heartbeaten for this long and resume "
                        "them (0: never); keep it above the longest step")
    p.add_argument("--drafter-deadline-ms", type=int, default=2_000,
                   help="a drafter step slower than this falls back to target-only decoding for its requests")
    p.add_argument("--drafter-refresh-s", type=float, default=10.0,
                   help="re-resolve --drafter names this often, adding drafters that appear and dropping "
                        "those that leave DNS (0: resolve once, at start)")
    p.add_argument("--async-emit", action=argparse.BooleanOptionalAction,
                   default=settings.ASYNC_EMIT.get(),
                   help="write each step's results on a writer thread, overlapping the next step "
                        "(--no-async-emit: the loop waits for every round trip; env SPECD_ASYNC_EMIT=0)")
    p.add_argument("--log-level", default="INFO")
    add_threads_argument(p)
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between summary lines (0: off)")
    add_tls_arguments(p)  # it connects to drafters and the grammar service, and serves its admin port
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.tp != 1:  # refuse before loading anything
        print(f"specd verifier: error: --tp {args.tp}: tensor parallelism is not available yet in specd; "
              "run one verifier per GPU with --tp 1", file=sys.stderr)
        return 2
    import redis

    from services.verifier.server import (PortInUseError, VerifierConfig, configure_logging, default_consumer_name,
                                          serve)
    from specd.host_threads import size_threads

    configure_logging(args.log_level)
    size_threads("verifier", args.device, args.threads)
    config = VerifierConfig(
        model=args.model, redis_url=args.redis_url, request_stream=args.request_stream,
        consumer=args.consumer or default_consumer_name(),
        drafters=[a.strip() for a in args.drafter.split(",") if a.strip()],
        grammar=args.grammar,
        speculative_algorithm=args.speculative_algorithm, speculative_draft_model=args.speculative_draft_model,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        speculative_adaptive=args.speculative_adaptive, max_batch_size=args.max_batch_size,
        session_len=args.session_len, device=args.device, tp=args.tp, admin_host=args.admin_host,
        admin_port=args.admin_port, metrics_port=args.metrics_port, block_size=args.block_size,
        log_interval_s=args.log_interval, reclaim_idle_ms=args.reclaim_idle_ms,
        drafter_deadline_ms=args.drafter_deadline_ms, drafter_refresh_s=args.drafter_refresh_s,
        tls=TLSConfig.from_args(args), async_emit=args.async_emit, eager_mode=args.eager_mode,
        enable_prefix_caching=args.enable_prefix_caching)
    try:
        return serve(config)
    except PortInUseError as e:
        print(f"specd verifier: error: {e}", file=sys.stderr)
        return 2
    except redis.RedisError as e:
        print(f"specd verifier: error: redis at {args.redis_url}: {e}", file=sys.stderr)
        return 1
