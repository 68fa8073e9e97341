"""Time to first token of multi-turn chats that share a system prompt, prefix caching on and off,
side by side in one run (the in-process engine: the verifier's own prefill, without the services).

Each conversation's turn t sends the system prompt, the earlier turns and their replies, and a new
user message; requests run one at a time, so a request's first step is its own prefill.

    .venv/bin/python bench/prefix_cache.py --system 1500 --conversations 8 --turns 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specd.engine.builder import build_engine  # noqa: E402
from specd.messages import PytorchEngineConfig  # noqa: E402
from specd.sampling_params import SamplingParams  # noqa: E402


def chat(model: str, caching: bool, system: int, conversations: int, turns: int, reply: int, seed: int = 0
         ) -> tuple[list[float], int, int]:
    """(seconds to each request's first token, prompt tokens prefilled, found cached)."""
    engine = build_engine(model, PytorchEngineConfig(max_batch_size=1, enable_prefix_caching=caching))
    rng = random.Random(seed)
    vocab = engine.runner.info.vocab_size
    shared = [rng.randrange(16, vocab) for _ in range(system)]
    histories = [list(shared) for _ in range(conversations)]
    params = SamplingParams(max_new_tokens=reply, ignore_eos=True)
    ttfts = []
    for _ in range(turns):
        for history in histories:
            history += [rng.randrange(16, vocab) for _ in range(rng.randint(8, 40))]  # the user's message
            seq = engine.add_request(history, params)
            t0 = time.perf_counter()
            while not seq.output_token_ids:
                engine.step()
            ttfts.append(time.perf_counter() - t0)
            while engine.has_unfinished():
                engine.step()
            history += seq.output_token_ids
    return ttfts, engine.stats.num_prefill_tokens, engine.stats.num_prefix_hit_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "specd-py-target"))
    p.add_argument("--system", type=int, default=1500, help="shared system prompt tokens")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--reply", type=int, default=16, help="tokens generated a turn")
    args = p.parse_args()
    rows = {}
    for caching in (False, True):
        rows[caching] = chat(args.model, caching, args.system, args.conversations, args.turns, args.reply)
    print(f"prefix caching, {args.conversations} conversations x {args.turns} turns, system prompt "
          f"{args.system} tokens, {args.reply} tokens a reply, {args.model}\n")
    print("| caching | TTFT p50 ms | TTFT p90 ms | prompt tokens prefilled | found cached |")
    print("|---|---|---|---|---|")
    for caching, (ttfts, prefilled, hits) in rows.items():
        q = statistics.quantiles(ttfts, n=10)
        print(f"| {'on' if caching else 'off'} | {statistics.median(ttfts) * 1e3:.1f} | {q[8] * 1e3:.1f} | "
              f"{prefilled} | {hits} |")
    ratio = statistics.median(rows[False][0]) / statistics.median(rows[True][0])
    print(f"\nTTFT p50 off / on: {ratio:.2f}x")


if __name__ == "__main__":
    main()
