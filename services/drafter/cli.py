"""`specd drafter MODEL ...`: run the drafter service (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse
import re

from services.common.tls import TLSConfig, add_tls_arguments  # no grpc import: cheap
from specd import settings
from specd.host_threads import add_threads_argument

METHODS = ("eagle3", "deepseek_mtp", "qwen3_5_mtp", "draft_model", "ngram", "replay")  # replay: bench only


def _device(value: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {value!r}")
    return value


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the `drafter` subcommand on the `specd` parser's subparsers."""
    p = sub.add_parser("drafter", help="serve draft tokens to verifiers over gRPC",
                       description="The drafter service: holds per-request draft state and proposes "
                                   "draft tokens for a verifier's batch, one stream message per step.")
    p.add_argument("model", help="target checkpoint (vocabulary and hidden width; MTP heads and "
                                 "EAGLE-3's embeddings are read from it, its weights are not loaded)")
    p.add_argument("--speculative-algorithm", required=True, choices=METHODS)
    p.add_argument("--speculative-draft-model", help="draft checkpoint (eagle3, draft_model)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--device", type=_device, default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--max-num-draft-tokens", type=int, default=32,
                   help="largest k a verifier may ask for per sequence and step")
    p.add_argument("--max-batch-size", type=int, default=128,
                   help="draft_model: sequences its KV cache is sized for (all verifiers together)")
    p.add_argument("--cache-max-entry-count", type=float, default=0.8,
                   help="draft_model on a GPU: the fraction of free GPU memory its KV cache may take (as "
                        "the target's flag of that name); `specd serve api_server` passes a tenth when the "
                        "drafter shares the verifier's GPU")
    p.add_argument("--eager-mode", action="store_true",
                   help="no CUDA graphs for the drafter's steps (draft_model's, the EAGLE-3 / MTP heads')")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="ngram: shortest suffix to match")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix to match")
    # Bench only (specd/proposers/replay.py); the environment variables let bench/ set them through
    # the launcher, which knows nothing of replay.
    p.add_argument("--replay-references", default=settings.REPLAY_REFERENCES.get(),
                   help="replay (bench only): JSON-lines file of prompt -> greedy output")
    p.add_argument("--replay-corrupt-rate", type=float,
                   default=settings.REPLAY_CORRUPT_RATE.get(),
                   help="replay (bench only): probability that a draft token is corrupted")
    p.add_argument("--max-workers", type=int, default=32,
                   help="gRPC threads; each open verifier stream holds one")
    p.add_argument("--fast-step-port", type=int, default=settings.DRAFTER_FAST_STEP_PORT.get(),
                   help="serve the per-step round trip over framed sockets too, on this port (0: any free "
                        "port, advertised to verifiers in Info; -1: gRPC only). Not under TLS.")
    p.add_argument("--log-level", default="INFO")
    add_threads_argument(p)
    add_tls_arguments(p, client=False)
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    import logging

    from services.drafter.server import serve_drafter
    from specd.host_threads import size_threads
    from specd.messages import SpeculativeConfig

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    size_threads("drafter", args.device, args.threads)
    spec = SpeculativeConfig(method=args.speculative_algorithm,
                             num_speculative_tokens=min(args.max_num_draft_tokens, 32),
                             model=args.speculative_draft_model or "",
                             prompt_lookup_min=args.prompt_lookup_min,
                             prompt_lookup_max=args.prompt_lookup_max,
                             replay_references=args.replay_references,
                             replay_corrupt_rate=args.replay_corrupt_rate)
    serve_drafter(args.speculative_draft_model or args.model, spec, target_path=args.model,
                  host=args.host, port=args.port, device=args.device, dtype=args.dtype,
                  max_num_draft_tokens=args.max_num_draft_tokens, max_batch_size=args.max_batch_size,
                  cache_max_entry_count=args.cache_max_entry_count, max_workers=args.max_workers,
                  tls=TLSConfig.from_args(args), fast_step_port=args.fast_step_port, eager_mode=args.eager_mode)
    return 0
