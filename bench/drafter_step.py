"""One drafter step as its serving thread runs it (services/drafter/servicer.py `_step`, between the
fast path's frame read and its write): the request parsed, every sequence's new tokens taken and
its drafts proposed, the answer built and serialized. CPU, no sockets, replay and n-gram drafters.

The verifier waits for this at every step whose drafts it did not carry (the drafter's
own time per round trip on the GPU machines, 0.8-1.7 ms at batch 64-128), so it is on the critical
path. BENCHMARKS.md, "Drafter host time (CPU)", has this bench's figures.
Each step commits 4 tokens per sequence and asks k + carry = 11 drafts, as the e2e bench's replay
stacks do at k = 3.

    .venv/bin/python -m bench.drafter_step [--batches 1,64,128] [--steps 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from services.drafter.servicer import DrafterServicer
from specd.proposers.ngram import NgramProposer
from specd.proposers.replay import ReplayProposer
from specd.v1 import drafter_pb2

VOCAB, TOKENS_PER_STEP, NUM_DRAFTS = 128256, 4, 11


def step_us(method: str, batch: int, steps: int) -> tuple[float, float, float]:
    """Median (parse, step, serialize) us of one drafter step at this batch."""
    rng = random.Random(0)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(16, 48))] for _ in range(batch)]
    # Outputs that repeat phrases, so the n-gram drafter finds continuations as it would in text.
    phrases = [[rng.randrange(4, VOCAB) for _ in range(8)] for _ in range(50)]
    outputs = [[t for _ in range(steps * TOKENS_PER_STEP // 8 + 2) for t in rng.choice(phrases)] for _ in prompts]
    proposer = (ReplayProposer({tuple(p): o for p, o in zip(prompts, outputs)}, VOCAB) if method == "replay"
                else NgramProposer())
    servicer = DrafterServicer(proposer, vocab_size=VOCAB, max_num_draft_tokens=16)
    stream = servicer.open_stream("bench")
    first = drafter_pb2.DraftStepRequest(step_id=0)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        first.open.add(seq_id=i)
        first.sequences.add(seq_id=i, new_token_ids=prompt + output[:1], num_draft_tokens=NUM_DRAFTS)
    servicer._step(stream, first)
    parse, step, serialize = [], [], []
    for s in range(steps):
        request = drafter_pb2.DraftStepRequest(step_id=s + 1)
        lo = 1 + s * TOKENS_PER_STEP
        for i, output in enumerate(outputs):
            request.sequences.add(seq_id=i, new_token_ids=output[lo:lo + TOKENS_PER_STEP], num_draft_tokens=NUM_DRAFTS)
        payload = request.SerializeToString()
        t0 = time.perf_counter()
        message = drafter_pb2.DraftStepRequest.FromString(payload)
        t1 = time.perf_counter()
        answer = servicer._step(stream, message)
        t2 = time.perf_counter()
        answer.SerializeToString()
        t3 = time.perf_counter()
        parse.append(t1 - t0)
        step.append(t2 - t1)
        serialize.append(t3 - t2)
    return tuple(statistics.median(x) * 1e6 for x in (parse, step, serialize))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,128")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    print(f"one drafter step, {TOKENS_PER_STEP} new tokens and {NUM_DRAFTS} drafts per sequence, "
          f"median of {args.steps} steps\n")
    print("| method | batch | parse us | step us | serialize us | us per sequence |\n|---|---|---|---|---|---|")
    for method in ("replay", "ngram"):
        for b in (int(x) for x in args.batches.split(",")):
            parse, step, serialize = step_us(method, b, args.steps)
            print(f"| {method} | {b} | {parse:.0f} | {step:.0f} | {serialize:.0f} | "
                  f"{(parse + step + serialize) / b:.1f} |")


if __name__ == "__main__":
    main()
