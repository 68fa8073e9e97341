"""The engine's own host time per step (admission, drafting, the verify step's launch and sampling
set-up, commit), with the target's forward body stubbed out: what every step pays in Python
whatever the model, measured where it can be, on the CPU.

The runner is the real static path (specd/models/cuda_graphs.py: layout, the fill of its input
buffer, block tables) over a toy Llama; only `StaticForward._body`, the part a CUDA graph replays,
is replaced by a stub whose logits accept every draft (k = 3, greedy, so each step verifies 4
tokens per sequence and keeps them all). The proposer is in-process and answers from a fixed list,
so its own cost stays out. On the GPU the same host work runs while the device is idle before the
launch (bookkeeping, fill) or overlaps the forward (sampling set-up); here it is the whole step.

    .venv/bin/python bench/engine_host.py --batches 1,8,64,128 [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.step import arch_config, random_model  # noqa: E402
from specd.engine.engine import SpecEngine  # noqa: E402
from specd.messages import PytorchEngineConfig  # noqa: E402
from specd.models.cuda_graphs import StaticForward  # noqa: E402
from specd.models.llama_runner import LlamaRunner  # noqa: E402
from specd.proposers.base import DraftProposal  # noqa: E402
from specd.sampling_params import SamplingParams  # noqa: E402

K = 3
DRAFTS = [5, 6, 7]  # what the proposer drafts, and what the stub's logits prefer at each row


class FixedProposer:
    """Drafts DRAFTS[:k] for every sequence: no work of its own."""

    method = "fixed"
    hidden_kind = "none"
    draft_constraints = None

    def open(self, seq_id, params, grammar=None) -> None:
        pass

    def close(self, seq_id) -> None:
        pass

    def propose(self, requests):
        return [DraftProposal(torch.tensor(DRAFTS[:r.num_draft_tokens], dtype=torch.long)) for r in requests]


def _stub_body(vocab: int, hidden: int):
    def body(self, entry, aux_layer_ids, after_layer=None) -> None:
        if getattr(entry, "stub_outputs", False):
            return
        rows = entry.batch * entry.qlen
        entry.logits = torch.zeros(rows, vocab)
        cycle = DRAFTS + [8]  # row j of a verify chunk prefers draft j + 1, then a bonus token
        prefer = torch.tensor([cycle[j % len(cycle)] for j in range(entry.qlen)] * entry.batch)
        entry.logits[torch.arange(rows), prefer] = 1.0
        entry.hidden, entry.aux = torch.zeros(rows, hidden), None
        entry.stub_outputs = True
    return body


def host_us_per_step(batch: int, steps: int) -> tuple[float, float]:
    """(median, mean) engine host us per step at this batch, every draft accepted."""
    config = arch_config("small")
    model = random_model(config, torch.float32, torch.device("cpu"))
    engine_config = PytorchEngineConfig(max_batch_size=batch, block_size=16, num_gpu_blocks=batch * 600,
                                        session_len=8192, device_type="cpu", dtype="float32")
    runner = LlamaRunner(".", engine_config, model=model, config=config, use_static_path=True, compile_mode="0")
    engine = SpecEngine(runner, FixedProposer(), K, max_batch_size=batch, max_model_len=8192, draft_ahead=False)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 500 + 3 for j in range(24)],
                           SamplingParams(max_new_tokens=8000, ignore_eos=True))
    times = []
    with mock.patch.object(StaticForward, "_body", _stub_body(config.vocab_size, config.hidden_size)):
        for _ in range(20):  # admission and the first layouts
            engine.step()
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1e6)
    accepted = sum(s.stats.num_accepted_tokens for s in engine.running)
    drafted = sum(s.stats.num_draft_tokens for s in engine.running)
    assert accepted == drafted > 0, "the stub should accept every draft"
    return statistics.median(times), statistics.fmean(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the host path is one thread; torch's pool would add noise here
    print(f"engine host time per step (k = {K}, every draft accepted, forward body stubbed), "
          f"{args.steps} steps\n")
    print("| batch | median us | mean us | us per sequence |\n|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        median, mean = host_us_per_step(batch, args.steps)
        print(f"| {batch} | {median:.0f} | {mean:.0f} | {median / batch:.1f} |")


if __name__ == "__main__":
    main()
