"""The engine's own host time per step (admission, drafting, the verify step's launch and sampling
set-up, commit), with the target's forward body stubbed out: what every step pays in Python
whatever the model, measured where it can be, on the CPU.

The runner is the real static path (specd/models/cuda_graphs.py: layout, the fill of its input
buffer, block tables) over a toy Llama; only `StaticForward._body`, the part a CUDA graph replays,
is replaced by a stub whose logits accept every draft (k = 3, greedy, so each step verifies 4
tokens per sequence and keeps them all). The proposer is in-process and answers from a fixed list,
so its own cost stays out. On the GPU the same host work runs while the device is idle before the
launch (bookkeeping, fill) or overlaps the forward (sampling set-up); here it is the whole step.

    .venv/bin/python bench/engine_host.py --batches 1,8,64,128 [--steps 200] [--decode]

With `--round-trip-us N` the proposer answers as the remote drafters do, N us after each send
(drafts sent ahead), and the table sets the verify batch staged while they are out against not
staged: the step, and its launch (the host work between the drafts' arrival and the forward).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.step import arch_config, random_model  # noqa: E402
from specd.engine.engine import SpecEngine  # noqa: E402
from specd import settings  # noqa: E402

STAGE_VERIFY_ENV = settings.STAGE_VERIFY.name
from specd.messages import PytorchEngineConfig  # noqa: E402
from specd.models.cuda_graphs import StaticForward  # noqa: E402
from specd.models.llama_runner import LlamaRunner  # noqa: E402
from specd.proposers.base import DraftProposal  # noqa: E402
from specd.sampling_params import SamplingParams  # noqa: E402

K = 3
DRAFTS = [5, 6, 7]  # what the proposer drafts, and what the stub's logits prefer at each row


class FixedProposer:
    """Drafts DRAFTS[:k] for every sequence: no work of its own. With a round trip, it also
    answers "asynchronously" as the remote drafters do (propose_async): the drafts are ready
    that long after the send, so the engine sends them ahead and stages the next verify batch
    meanwhile (specd/engine/staging.py)."""

    def __init__(self, round_trip_s: float | None = None) -> None:
        if round_trip_s is not None:
            self.propose_async = lambda requests: _Pending(self.propose(requests), round_trip_s)

    method = "fixed"
    hidden_kind = "none"
    draft_constraints = None

    def open(self, seq_id, params, grammar=None) -> None:
        pass

    def close(self, seq_id) -> None:
        pass

    def propose(self, requests):
        return [DraftProposal(torch.tensor(DRAFTS[:r.num_draft_tokens], dtype=torch.long)) for r in requests]


class _Pending:
    def __init__(self, proposals, round_trip_s: float) -> None:
        self.proposals, self.ready_at = proposals, time.perf_counter() + round_trip_s

    def result(self):
        while time.perf_counter() < self.ready_at:  # a spin: a sleep's wake-up would be the noise
            pass
        return self.proposals


def _stub_body(vocab: int, hidden: int):
    def body(self, entry, aux_layer_ids) -> None:
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


def host_us_per_step(batch: int, steps: int, round_trip_s: float | None = None, *, decode: bool = False
                     ) -> tuple[float, float, float]:
    """(median, mean) engine host us per step at this batch, every draft accepted, and the
    median launch us (the verify step's host work before its forward is queued). decode:
    speculation off, greedy decode steps queued ahead (specd/engine/overlap.py)."""
    config = arch_config("small")
    model = random_model(config, torch.float32, torch.device("cpu"))
    engine_config = PytorchEngineConfig(max_batch_size=batch, block_size=16, num_gpu_blocks=batch * 600,
                                        session_len=8192, device_type="cpu", dtype="float32")
    runner = LlamaRunner(".", engine_config, model=model, config=config, use_static_path=True)
    if decode:
        engine = SpecEngine(runner, None, 0, max_batch_size=batch, max_model_len=8192)
    else:
        engine = SpecEngine(runner, FixedProposer(round_trip_s), K, max_batch_size=batch, max_model_len=8192,
                            draft_ahead=round_trip_s is not None, draft_carry=0)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 500 + 3 for j in range(24)],
                           SamplingParams(max_new_tokens=8000, ignore_eos=True))
    times, launches = [], []
    with mock.patch.object(StaticForward, "_body", _stub_body(config.vocab_size, config.hidden_size)):
        for _ in range(20):  # admission and the first layouts
            engine.step()
        for _ in range(steps):
            launch0 = engine.stats.timings.launch
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1e6)
            launches.append((engine.stats.timings.launch - launch0) * 1e6)
    accepted = sum(s.stats.num_accepted_tokens for s in engine.running)
    drafted = sum(s.stats.num_draft_tokens for s in engine.running)
    assert accepted == drafted and (decode or drafted > 0), "the stub should accept every draft"
    return statistics.median(times), statistics.fmean(times), statistics.median(launches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--round-trip-us", type=float, default=None,
                    help="drafts sent ahead, ready this long after the send: staging off vs on")
    ap.add_argument("--decode", action="store_true", help="speculation off: overlapped greedy decode steps")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the host path is one thread; torch's pool would add noise here
    if args.decode:
        print(f"engine host time per decode step (speculation off, overlapped, forward body stubbed), "
              f"{args.steps} steps\n")
        print("| batch | median us | mean us | us per sequence |\n|---|---|---|---|")
        for batch in (int(b) for b in args.batches.split(",")):
            median, mean, _ = host_us_per_step(batch, args.steps, decode=True)
            print(f"| {batch} | {median:.0f} | {mean:.0f} | {median / batch:.1f} |")
        return
    if args.round_trip_us is None:
        print(f"engine host time per step (k = {K}, every draft accepted, forward body stubbed), "
              f"{args.steps} steps\n")
        print("| batch | median us | mean us | us per sequence |\n|---|---|---|---|")
        for batch in (int(b) for b in args.batches.split(",")):
            median, mean, _ = host_us_per_step(batch, args.steps)
            print(f"| {batch} | {median:.0f} | {mean:.0f} | {median / batch:.1f} |")
        return
    round_trip = args.round_trip_us / 1e6
    print(f"engine step with drafts sent ahead, ready {args.round_trip_us:.0f} us after the send (k = {K}, "
          f"every draft accepted, forward body stubbed), {args.steps} steps, median us; staging "
          f"({STAGE_VERIFY_ENV}) off and on, alternating\n")
    print("| batch | step off | step on | on / off | launch off | launch on |\n|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        runs = {}
        for setting in ("0", "1", "0", "1"):  # two rounds each, alternating
            with mock.patch.dict(os.environ, {STAGE_VERIFY_ENV: setting}):
                runs.setdefault(setting, []).append(host_us_per_step(batch, args.steps, round_trip))
        (off, _, l_off), (on, _, l_on) = (min(runs[k]) for k in ("0", "1"))
        print(f"| {batch} | {off:.0f} | {on:.0f} | {on / off:.3f}x | {l_off:.0f} | {l_on:.0f} |")


if __name__ == "__main__":
    main()
