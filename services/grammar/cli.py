"""`specd grammar MODEL ...`: run the grammar service (imports nothing heavy until it runs)."""

from __future__ import annotations

import argparse

from services.common.tls import TLSConfig, add_tls_arguments  # no grpc import: cheap
from specd.host_threads import add_threads_argument


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the `grammar` subcommand on the `specd` parser's subparsers."""
    p = sub.add_parser("grammar", help="serve structured-output grammar masks to verifiers over gRPC",
                       description="The grammar service: compiles response formats (JSON schema, "
                                   "regex, EBNF) for one model's tokenizer and holds a matcher per "
                                   "constrained request; one stream message per engine step.")
    p.add_argument("model", help="checkpoint whose tokenizer, vocab_size and eos ids the grammars "
                                 "use (its weights are not loaded)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50081)
    p.add_argument("--cache-entries", type=_positive, default=256,
                   help="compiled grammars kept (least recently used ones are dropped)")
    p.add_argument("--max-workers", type=_positive, default=32,
                   help="gRPC threads; each open verifier stream holds one")
    p.add_argument("--log-level", default="info")
    add_threads_argument(p)
    add_tls_arguments(p, client=False)
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    import logging

    from services.grammar.server import serve_grammar
    from specd.host_threads import size_threads

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    size_threads("grammar", "cpu", args.threads)
    serve_grammar(args.model, host=args.host, port=args.port, cache_entries=args.cache_entries,
                  max_workers=args.max_workers, tls=TLSConfig.from_args(args))
    return 0
