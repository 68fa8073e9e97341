"""The EAGLE-3 drafter's own step, in-process: PairHeadProposer.propose (specd/proposers/pair_head.py)
over an 8B-shaped head with random weights, as the drafter service runs it each round trip: every
sequence brings the tokens and target rows its last step committed, then gets k drafts.

Why: through the services the eagle3 drafter's own time per round trip is many times what reading
the head's weights costs (~1 GB in bf16, ~0.3 ms a draft step on an H100). This times the step, and
splits it with torch.profiler (--profile), without the services around it. Each batch runs through
the fixed-shape forwards the drafter takes on CUDA (specd/proposers/head_graphs.py) and the eager
ones (BatchKV); --gathered adds the fixed-shape forwards with a gathered attention instead of the
in-place block reads, --kv-blocks N head caches of N-position blocks, --grammar-support structured
output enabled with no grammar in the batch (as the services' drafters run), and --cudnn eager
with SDPA's own kernel choice (cuDNN first on Hopper; see specd/models/sdpa_backends.py).

    python -m bench.drafter_head [--batches 1,64] [--steps 20] [--prompt-len 32] [--shape 8b|small] [--device cuda] [--kv-blocks 16] [--gathered]
        [--grammar-support] [--cudnn]
        [--profile [--trace DIR]]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from contextlib import contextmanager, nullcontext

import torch
from torch.nn.attention import SDPBackend

from specd.models import sdpa_backends
from specd.proposers.base import DraftRequest
from specd.proposers.draft_constraints import DraftConstraints
from specd.proposers.eagle3_head import Eagle3Config, Eagle3Head
from specd.proposers.head_kv import StaticBatchKV, masked_attention
from specd.proposers.pair_head import PairHeadProposer
from specd.sampling_params import SamplingParams

SHAPES = {  # the target's shape: the head's layer is one of its layers; the draft vocabulary half of it
    "8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=128256),
    "small": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=512),
}


def make_head(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Eagle3Head:
    s = SHAPES[shape]
    cfg = Eagle3Config(**s, draft_vocab_size=s["vocab_size"] // 2, target_hidden_size=s["hidden_size"],
                       raw={"rope_theta": 500000.0, "max_position_embeddings": 8192})
    torch.manual_seed(seed)
    with torch.device(device):
        head = Eagle3Head(cfg)
    for p in head.parameters():
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.02)
    head.d2t.copy_(torch.arange(cfg.draft_vocab_size, device=device))  # draft id d is target id 2d
    return head.to(dtype)


def make_proposer(head: Eagle3Head, device: torch.device, dtype: torch.dtype, static_steps: bool,
                  **options) -> PairHeadProposer:
    proposer = PairHeadProposer(head, device, dtype, static_steps=static_steps, **options)
    proposer.method, proposer.hidden_kind = "eagle3", "aux"
    return proposer


def with_grammar_support(proposer: PairHeadProposer) -> PairHeadProposer:
    """Structured output enabled as services/drafter/server.py enables it; the bench's requests
    bring no grammar, so the compiler (a tokenizer's tables) must never be built."""
    def no_compiler():
        raise RuntimeError("the bench's requests have no grammar: no compiler should be built")
    proposer.draft_constraints = DraftConstraints(no_compiler)
    return proposer


def time_steps(proposer: PairHeadProposer, batch: int, steps: int, k: int, prompt_len: int = 32,
               tokens_per_step: int = 2, profile: bool = False, trace: str | None = None
               ) -> tuple[list[float], str]:
    """ms of each propose() after the prompts' (not timed), and the profiler's table when asked
    (its Chrome trace written to `trace` when given)."""
    cfg = proposer.head.cfg
    device, dtype = proposer.device, proposer.dtype
    gen = torch.Generator().manual_seed(1)
    width = 3 * cfg.target_hidden_size

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, width, generator=gen).to(dtype)  # the wire's rows arrive on the host

    params = SamplingParams(temperature=0.0)
    first = []
    for i in range(batch):
        proposer.open(i, params)
        tokens = torch.randint(4, cfg.vocab_size, (prompt_len + 1,), generator=gen).tolist()
        prompt_rows = torch.randn(prompt_len, width, device=device, dtype=dtype)  # untimed: made in place
        first.append(DraftRequest(i, tokens, prompt_rows, k))
    proposer.propose(first)
    times = []
    table = ""

    def one_step() -> None:
        requests = [DraftRequest(i, torch.randint(4, cfg.vocab_size, (tokens_per_step,), generator=gen).tolist(),
                                 rows(tokens_per_step), k) for i in range(batch)]
        sync()
        t0 = time.perf_counter()
        proposer.propose(requests)  # greedy: its .tolist() waits for the device
        times.append((time.perf_counter() - t0) * 1e3)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(steps):
        one_step()
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            for _ in range(5):
                one_step()
        if trace:
            prof.export_chrome_trace(trace)
        keys = (["cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]
        table = "\n".join(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
                          for key in keys)  # the device's view, then the host's
    for i in range(batch):
        proposer.close(i)
    return times, table


@contextmanager
def gathered_static_attention():
    """The fixed-shape forwards' attention through a gather instead of StaticBatchKV.attend's
    in-place reads: every sequence's keys gathered, joined to the new ones, repeated per query
    head, SDPA."""
    saved = StaticBatchKV.attend
    StaticBatchKV.attend = lambda self, q, k, v, scale: masked_attention(q, *self.update(k, v), self.mask, scale)
    try:
        yield
    finally:
        StaticBatchKV.attend = saved


@contextmanager
def cudnn_attention_allowed():
    """SDPA's default choice inside (cuDNN first on Hopper), which sdpa_backends.py rules out: the A/B."""
    saved = sdpa_backends.VARIABLE_SHAPE_BACKENDS
    sdpa_backends.VARIABLE_SHAPE_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *saved]
    try:
        yield
    finally:
        sdpa_backends.VARIABLE_SHAPE_BACKENDS = saved


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32, help="positions each sequence caches first")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's top ops per batch")
    ap.add_argument("--trace", default="", help="with --profile: a folder for each run's Chrome trace")
    ap.add_argument("--kv-blocks", default="", help="also the fixed-shape forwards over head caches of "
                    "these block sizes, e.g. 16 (default blocks: head_kv.BLOCK)")
    ap.add_argument("--gathered", action="store_true",
                    help="also the fixed-shape forwards with the gathered attention (before the paged read)")
    ap.add_argument("--grammar-support", action="store_true",
                    help="also the fixed-shape forwards with structured output enabled (no grammar in the batch)")
    ap.add_argument("--cudnn", action="store_true", help="also eager with SDPA's own kernel choice (cuDNN first)")
    args = ap.parse_args(argv)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = make_head(args.shape, device, dtype)
    variants = [("static", make_proposer(head, device, dtype, True), nullcontext),
                ("eager", make_proposer(head, device, dtype, False), nullcontext)]
    for size in (int(n) for n in args.kv_blocks.split(",") if n):
        variants.append((f"static, {size}-position blocks",
                         make_proposer(head, device, dtype, True, kv_block_size=size), nullcontext))
    if args.gathered:
        variants.append(("static, gathered", make_proposer(head, device, dtype, True), gathered_static_attention))
    if args.grammar_support:
        variants.append(("static, grammar support", with_grammar_support(make_proposer(head, device, dtype, True)),
                         nullcontext))
    if args.cudnn:
        variants.append(("eager, cuDNN allowed", variants[1][1], cudnn_attention_allowed))
    graphs = "CUDA graphs" if device.type == "cuda" else "no graphs on CPU: the same buffers, eagerly"
    print(f"EAGLE-3 head, {args.shape} shape, {dtype}, {device}, k = {args.k}, {args.prompt_len}-token "
          f"prompts: ms per propose "
          f"(median of {args.steps}, after the prompts'; min-max), alternated per batch. static: "
          f"the fixed-shape forwards ({graphs}); eager: BatchKV's\n")
    names = [name for name, _, _ in variants]
    print("| batch | " + " | ".join(f"{n} ms" for n in names) + " | "
          + " | ".join(f"{n} / static" for n in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    tables = []
    for batch in (int(b) for b in args.batches.split(",")):
        medians, cells = [], []
        for label, proposer, scope in variants:
            with scope():
                trace = f"{args.trace}/b{batch}-{label.replace(', ', '-').replace(' ', '_')}.json" if args.trace else None
                times, table = time_steps(proposer, batch, args.steps, args.k, prompt_len=args.prompt_len,
                                          profile=args.profile, trace=trace)
            medians.append(statistics.median(times))
            cells.append(f"{medians[-1]:.2f} ({min(times):.2f}-{max(times):.2f})")
            tables.append((batch, label, table))
        ratios = [f"{m / medians[0]:.2f}x" for m in medians[1:]]
        print(f"| {batch} | " + " | ".join(cells + ratios) + " |", flush=True)
    static = variants[0][1].graphs
    print(f"\nstatic: {static.num_static_forwards} fixed-shape forwards, {static.num_captures} graphs "
          f"captured in {static.capture_seconds:.2f} s, {static.num_capture_failures} capture failures")
    for batch, label, table in tables:
        if table:
            print(f"\nbatch {batch}, {label}, 5 steps:\n{table}")


if __name__ == "__main__":
    main()
