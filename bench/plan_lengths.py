"""A step's draft-length plan (specd/engine/drafting.py `plan_draft_lengths`): sequence-by-sequence
claims against the roomy-cache shortcut, side by side in one run (CPU, no model).

Every step plans k per running sequence over the cache's free blocks. With room for every
sequence's k + 1 tokens at once (AppendPlan.fits_everyone) the plan takes a shortcut to the same
ks; without the block size the plan cannot tell, so it claims block by block.

    .venv/bin/python -m bench.plan_lengths [--batches 1,64,128] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from specd.engine.drafting import plan_draft_lengths
from specd.engine.sequence import Sequence
from specd.models.append_plan import AppendPlan
from specd.models.kv_cache import PagedKVCache
from specd.sampling_params import SamplingParams

K, BLOCK = 3, 16


def plan_us(batch_size: int, calls: int, shortcut: bool) -> float:
    """Median us of one plan over batch_size sequences of 100-227 cached tokens, a roomy cache."""
    kv = PagedKVCache(1, batch_size * 100, BLOCK, 1, 8)
    batch = []
    for i in range(batch_size):
        kv.add_sequence(i)
        kv.append_slots(i, 100 + i)
        batch.append(Sequence(i, [3] * (101 + i), SamplingParams(max_new_tokens=1000, ignore_eos=True)))
    times = []
    for _ in range(calls):
        plan = AppendPlan(kv.allocator.num_free_blocks, kv.num_tokens, kv.num_new_blocks, None,
                          block_size=BLOCK if shortcut else None)
        t0 = time.perf_counter()
        plan_draft_lengths(batch, plan, K, 8192)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,128")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    print(f"plan_draft_lengths, k = {K}, median of {args.calls} calls\n")
    print("| batch | claims us | shortcut us | claims / shortcut |\n|---|---|---|---|")
    for b in (int(x) for x in args.batches.split(",")):
        claims, shortcut = plan_us(b, args.calls, False), plan_us(b, args.calls, True)
        print(f"| {b} | {claims:.1f} | {shortcut:.1f} | {claims / shortcut:.2f}x |")


if __name__ == "__main__":
    main()
