"""The n-gram drafter's cost per step: the index it keeps (NgramIndex) against a scan of each
sequence's whole history (find_ngram_continuation, the definition), side by side in one run.

Histories are text-like: phrases of 8 tokens drawn from a pool of 200 (vocabulary 32,000), so
suffixes recur as in code and prose; each sequence starts from a 1,024-token prompt and each step
commits 3 more tokens and asks for k = 3 drafts, for every sequence of the batch (what one drafter
step does). Both sides must propose the same drafts.

    .venv/bin/python bench/ngram_lookup.py                    # batch 1, 64, 128; ~30 s
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specd.proposers.base import DraftRequest  # noqa: E402  (after the path setup)
from specd.proposers.ngram import NgramProposer, find_ngram_continuation  # noqa: E402
from specd.sampling_params import SamplingParams  # noqa: E402

VOCAB, PHRASE_LEN = 32000, 8


def text_like(rng: random.Random, pool: list[list[int]], length: int) -> list[int]:
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(pool)
    return out[:length]


def run(batch: int, prompt_len: int, steps: int, k: int, phrases: int = 200, seed: int = 0) -> dict:
    rng = random.Random(seed)
    pool = [[rng.randrange(VOCAB) for _ in range(PHRASE_LEN)] for _ in range(phrases)]
    streams = [text_like(rng, pool, prompt_len + 3 * steps) for _ in range(batch)]
    proposer = NgramProposer(1, 4)
    histories: list[list[int]] = [[] for _ in range(batch)]
    for i in range(batch):
        proposer.open(i, SamplingParams())
    index_s = scan_s = 0.0
    drafted = 0
    for step in range(steps + 1):
        end = prompt_len + 3 * step
        new = [s[len(h):end] for s, h in zip(streams, histories)]
        t0 = time.perf_counter()
        proposals = proposer.propose([DraftRequest(i, new[i], None, k) for i in range(batch)])
        t1 = time.perf_counter()
        for i in range(batch):
            histories[i] += new[i]
        scanned = [find_ngram_continuation(np.asarray(h, dtype=np.int64), 1, 4, k).tolist() for h in histories]
        t2 = time.perf_counter()
        got = [p.token_ids.tolist() for p in proposals]
        assert got == scanned, f"step {step}: the index and the scan disagree"
        if step:  # step 0 indexes the prompts (an admission, not a decode step)
            index_s += t1 - t0
            scan_s += t2 - t1
        drafted += sum(map(len, got))
    return {"batch": batch, "index_ms": index_s / steps * 1e3, "scan_ms": scan_s / steps * 1e3,
            "drafts_per_seq_step": drafted / (batch * (steps + 1))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,128")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--phrases", type=int, default=200, help="the pool the histories are drawn from")
    args = ap.parse_args()
    print("| batch | index ms per step | scan ms per step | scan / index | drafts per sequence step |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        r = run(batch, args.prompt_len, args.steps, args.k, args.phrases)
        print(f"| {batch} | {r['index_ms']:.3f} | {r['scan_ms']:.3f} | {r['scan_ms'] / r['index_ms']:.1f}x | "
              f"{r['drafts_per_seq_step']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
