"""Structured output with speculation: acceptance with draft masking on versus off, and the grammar
work per step (in-process matchers, and the grammar service over gRPC) against the step time.

    .venv/bin/python bench/structured_output.py --method draft_model --num-schemas 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.shared_data import jsonschemabench_dir  # noqa: E402
from specd.engine.builder import build_engine  # noqa: E402
from specd.grammar.backend import GrammarSpec  # noqa: E402
from specd.grammar.compiler import GrammarCompilerCache  # noqa: E402
from specd.grammar.local import LocalGrammarBackend  # noqa: E402
from specd.messages import PytorchEngineConfig, SpecStats, SpeculativeConfig  # noqa: E402
from specd.proposers.draft_constraints import DraftConstraints  # noqa: E402
from specd.sampling_params import SamplingParams  # noqa: E402

SCHEMAS = jsonschemabench_dir()
DRAFTS = {"eagle3": "draft-eagle3", "draft_model": "draft-llama-small"}


def run(target, spec, grammars, masking: bool, backend, max_tokens: int):
    cache = GrammarCompilerCache.from_model_dir(target)
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=len(grammars)), spec,
                          grammar_backend=backend or LocalGrammarBackend(cache))
    if masking and engine.proposer is not None:
        engine.proposer.draft_constraints = DraftConstraints(cache)
    prompts = [[5 + i % 50, 9, 13] for i in range(len(grammars))]
    params = [SamplingParams(max_new_tokens=max_tokens) for _ in grammars]
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params, grammars)
    elapsed = time.perf_counter() - t0
    stats = SpecStats()
    for s in seqs:
        stats.merge(s.stats)
    steps = engine.stats.num_steps
    return {"elapsed": elapsed, "steps": steps, "stats": stats, "grammar_s": engine.constraints.seconds,
            "tokens": sum(s.num_output_tokens for s in seqs), "outputs": [s.output_token_ids for s in seqs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, default=ROOT / ".tiny-models")
    ap.add_argument("--method", default="draft_model", choices=["eagle3", "draft_model", "ngram"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-schemas", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if not (args.models / "target-llama" / "config.json").exists():
        from specd.tiny_models.make import make_tiny_models

        make_tiny_models(args.models)
    target = args.models / "target-llama"
    draft = args.models / DRAFTS[args.method] if args.method in DRAFTS else None
    spec = SpeculativeConfig(method=args.method, num_speculative_tokens=args.k, model=str(draft or ""))
    files = sorted(SCHEMAS.glob("*/*.json"))[: args.num_schemas]
    grammars = [GrammarSpec("json_schema", f.read_text()) for f in files]

    on = run(target, spec, grammars, True, None, args.max_tokens)
    off = run(target, spec, grammars, False, None, args.max_tokens)
    assert on["outputs"] == off["outputs"], "draft masking must not change the output"

    from services.grammar.server import load_grammar, start_server
    from specd.clients.grammar import RemoteGrammarBackend

    server = start_server(load_grammar(target), "127.0.0.1", 0)
    try:
        remote = run(target, spec, grammars, True, RemoteGrammarBackend(server.address), args.max_tokens)
    finally:
        server.stop(1.0)
    assert remote["outputs"] == on["outputs"], "the grammar service must mask as the local matchers do"

    print(f"method={args.method} k={args.k} schemas={len(grammars)} max_tokens={args.max_tokens} (greedy)")
    print(f"{'':34}{'masking on':>12}{'masking off':>12}{'on, service':>12}")
    for label, key in (("mean acceptance length", "mal"), ("acceptance rate", "rate"),
                       ("engine steps", "steps"), ("step ms", "step_ms"), ("grammar ms per step", "gms")):
        row = []
        for r in (on, off, remote):
            value = {"mal": r["stats"].mean_acceptance_length, "rate": r["stats"].acceptance_rate,
                     "steps": r["steps"], "step_ms": 1e3 * r["elapsed"] / r["steps"],
                     "gms": 1e3 * r["grammar_s"] / r["steps"]}[key]
            row.append(f"{value:>12.3f}" if isinstance(value, float) else f"{value:>12}")
        print(f"{label:34}{''.join(row)}")
    print(f"grammar share of the step: local {on['grammar_s'] / on['elapsed']:.1%}, "
          f"service {remote['grammar_s'] / remote['elapsed']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
