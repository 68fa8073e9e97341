"""Mean acceptance length of every speculative method on held-out standard-library files.

Greedy, k draft tokens, prompts cut from files the training never saw (specd.train.corpus's
held-out split). Every method's output is also checked token for token against target-only greedy.

    .venv/bin/python bench/acceptance.py --models models --k 3
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specd.engine.builder import build_engine  # noqa: E402
from specd.messages import PytorchEngineConfig, SpecStats, SpeculativeConfig  # noqa: E402
from specd.sampling_params import SamplingParams  # noqa: E402
from specd.train.corpus import split_stdlib  # noqa: E402
from specd.train.family import NAMES  # noqa: E402

METHODS = ("eagle3", "deepseek_mtp", "draft_model", "ngram")
DRAFT_DIRS = {"eagle3": NAMES["eagle3"], "deepseek_mtp": NAMES["mtp"], "draft_model": NAMES["draft"]}


def held_out_prompts(tokenizer, num_prompts: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """Windows starting at a line start of held-out files, `prompt_tokens` long."""
    split = split_stdlib()
    texts = [t for t in split.texts("held_out") if len(t) > 2000]
    rng = random.Random(seed)
    prompts = []
    for text in rng.sample(texts, min(num_prompts, len(texts))):
        starts = [0] + [i + 1 for i, c in enumerate(text[:-1000]) if c == "\n"]
        start = rng.choice(starts)
        ids = tokenizer(text[start:start + 4 * prompt_tokens], add_special_tokens=False)["input_ids"]
        prompts.append(ids[:prompt_tokens])
    return prompts


def run(models: Path, method: str | None, prompts, k: int, max_new_tokens: int, batch: int):
    target = models / NAMES["target"]
    spec = None
    if method is not None:
        draft = str(models / DRAFT_DIRS[method]) if method in DRAFT_DIRS else ""
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k, model=draft)
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=batch), spec)
    params = [SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True) for _ in prompts]
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    stats = SpecStats()
    for s in seqs:
        stats.merge(s.stats)
    return {"outputs": [s.output_token_ids for s in seqs], "stats": stats, "seconds": elapsed,
            "steps": engine.stats.num_steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, default=ROOT / "models")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.models / NAMES["target"]))
    prompts = held_out_prompts(tokenizer, args.num_prompts, args.prompt_tokens, args.seed)
    base = run(args.models, None, prompts, args.k, args.max_new_tokens, args.batch)
    print(f"{len(prompts)} held-out prompts x {args.prompt_tokens} tokens, {args.max_new_tokens} "
          f"new tokens, greedy, k={args.k}; target-only: {base['steps']} steps, "
          f"{base['seconds']:.1f} s")
    print(f"{'method':<14}{'accept len':>11}{'accept rate':>12}{'per position':>28}"
          f"{'steps':>7}{'vs off':>8}{'lossless':>10}")
    figures = {}
    for method in args.methods.split(","):
        r = run(args.models, method, prompts, args.k, args.max_new_tokens, args.batch)
        st = r["stats"]
        per_pos = [round(a / st.num_drafts, 3) for a in st.accepted_per_position] if st.num_drafts else []
        same = r["outputs"] == base["outputs"]
        figures[method] = {"mean_acceptance_length": round(st.mean_acceptance_length, 3),
                           "acceptance_rate": round(st.acceptance_rate, 3),
                           "accepted_per_position": per_pos, "steps": r["steps"],
                           "steps_ratio_vs_off": round(base["steps"] / r["steps"], 3),
                           "lossless": same}
        print(f"{method:<14}{st.mean_acceptance_length:>11.3f}{st.acceptance_rate:>12.3f}"
              f"{str(per_pos):>28}{r['steps']:>7}{base['steps'] / r['steps']:>8.2f}{str(same):>10}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2), encoding="utf-8")
    return 0 if all(f["lossless"] for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
