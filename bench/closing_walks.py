"""Closing walks from random grammar states of every compiled jsonschemabench schema.

Budget-aware closing (specd/grammar/budget.py) can only close an output whose state has a closing
suffix (specd/grammar/closing.py) within the horizon. The schema sweep finds a state without one
only when a model happens to reach it (40 minutes for all configurations); this finds them in
seconds: for each schema the gateway would compile, it commits random prefixes of a few lengths
(random allowed tokens, every fourth or so the walk's own pick, so the prefixes move through the
structure rather than staying in the first string) and walks from the state each reaches. It
reports the states with no suffix within the horizon, the suffix lengths and the time per walk.

    .venv/bin/python bench/closing_walks.py                                   # the trained target
    .venv/bin/python bench/closing_walks.py --target .tiny-models/target-qwen3_5-mtp --stride 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.schema_sweep import MODELS, response_format_of, schema_files  # noqa: E402  (after the path setup)

LENGTHS = (0, 5, 15, 30, 60, 100, 150)  # prefix lengths in tokens
WALK_PICK_SHARE = 0.25  # of the prefix tokens, about this share is the closing walk's own pick


def random_prefix(grammar, preference, rng: random.Random, num_tokens: int, eos: set[int]) -> list[int]:
    """Commit up to num_tokens tokens the grammar allows (no stop token while another is allowed)."""
    from specd.grammar.masking import bitmask_to_bool

    tokens = []
    for _ in range(num_tokens):
        row = grammar.next_mask()
        allowed = bitmask_to_bool(row[None], grammar.vocab_size)[0]
        allowed[sorted(eos)] = False
        ids = allowed.nonzero().flatten()
        if not ids.numel():
            break
        token = preference.best(row) if rng.random() < WALK_PICK_SHARE else None
        if token is None or token in eos:
            token = int(ids[rng.randrange(ids.numel())])
        grammar.commit([token])
        tokens.append(token)
    return tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=MODELS / "specd-py-target")
    ap.add_argument("--stride", type=int, default=1, help="every N-th schema only")
    ap.add_argument("--schemas", nargs="+", default=None, metavar="FOLDER/FILE", help="only these schemas")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prefix lengths in tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from specd.grammar.closing import closing_suffix
    from specd.grammar.compiler import GrammarCompilerCache
    from specd.grammar.response_format import parse_response_format
    from specd.messages import ConfigError

    try:
        files = schema_files(stride=args.stride, names=args.schemas)
    except ValueError as e:
        ap.error(f"--schemas: {e}")
    cache = GrammarCompilerCache.from_model_dir(args.target, max_entries=len(files))
    preference, eos = cache.closing_preference(), set(cache.eos_token_ids)
    horizon = cache.closing.horizon
    num_compiled, lengths, seconds, no_suffix = 0, [], [], []
    for position, path in enumerate(files):
        name = f"{path.parent.name}/{path.name}"
        try:
            spec = parse_response_format(response_format_of(path.read_text(encoding="utf-8"), path.stem))
            cache.validate(spec)
        except ConfigError:  # GrammarCompileError among them: the gateway's 400
            continue
        num_compiled += 1
        rng = random.Random(args.seed * 100_003 + position)
        for num_tokens in args.lengths:
            grammar = cache.sequence_grammar(spec)
            prefix = random_prefix(grammar, preference, rng, num_tokens, eos)
            if grammar.is_terminated():
                continue
            t0 = time.perf_counter()
            suffix = closing_suffix(grammar.fork_drafts(), preference, horizon)
            seconds.append(time.perf_counter() - t0)
            if suffix is None:
                text = b"".join(preference.texts[t] for t in prefix)
                no_suffix.append((name, num_tokens, text[-60:]))
            else:
                lengths.append(len(suffix))
    print(f"{args.target.name}: {num_compiled} compiled schemas, {len(seconds)} walks, {len(no_suffix)} found no "
          f"suffix within {horizon} tokens")
    if lengths:
        ordered = sorted(lengths)
        print(f"suffix tokens: median {statistics.median(ordered):g}, p99 {ordered[int(0.99 * (len(ordered) - 1))]}, "
              f"max {ordered[-1]}; per walk: mean {1e3 * statistics.fmean(seconds):.2f} ms, "
              f"max {1e3 * max(seconds):.1f} ms")
    for name, num_tokens, text in no_suffix:
        print(f"  no suffix: {name} after {num_tokens} tokens: ...{text!r}")
    return 1 if no_suffix else 0


if __name__ == "__main__":
    sys.exit(main())
