"""Output tokens/s and time per output token through the full services, speculation off vs on.

One stack (embedded Redis, drafter, grammar, verifier, gateway: services/launcher) per method;
within it, each batch size B sends B greedy requests at once over the gRPC Generate API (token-id
prompts, ignore_eos, max_tokens each), in back-to-back waves of B distinct prompts until a round
holds `min_requests` (bench/e2e_rounds.py), after an identical warm-up round (CUDA graphs get captured
there; the row is the median of rounds that captured none, see median_round). "off" runs first: its outputs are the target's greedy
continuations, written as the replay drafter's references; "replay" then drafts them corrupted at
the rate whose expected acceptance length is `--replay-acceptance` (bench only, see
specd/proposers/replay.py). Ratios are against "off" at the same batch size, in the same run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.e2e_rounds import generate_waves, make_prompts, waves_for
from specd import settings

DRAFT_NAMES = {"eagle3": "draft-eagle3", "draft_model": "draft-llama-small"}


@dataclass
class E2ERow:
    method: str
    batch: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    tpot_ms: float  # mean over requests of (latency - time to first token) / (tokens - 1)
    acceptance_length: float  # measured: tokens per verify step with drafts (1.0 when off)
    expected_acceptance_length: float | None = None  # replay only
    speedup_vs_off: float | None = None
    rounds_tokens_per_s: list[float] | None = None  # every timed round; the row is median_round's
    step_ms: dict | None = None  # the verifier's mean ms per step in the median round, by phase
    rounds_captures: list[int] | None = None  # CUDA graphs the verifier captured in each timed round
    requests: int = 0  # in a round: waves of `batch` requests, back to back (waves_for)


def _row(method: str, batch: int, wall: float, replies) -> E2ERow:
    tokens = sum(len(r.token_ids) for r in replies)
    tpots = [(r.usage.latency_us - r.usage.time_to_first_token_us) / 1e3 / max(1, len(r.token_ids) - 1)
             for r in replies]
    drafts = sum(r.spec_stats.num_drafts for r in replies)
    accepted = sum(r.spec_stats.num_accepted_tokens for r in replies)
    return E2ERow(method, batch, tokens, wall, tokens / wall, sum(tpots) / len(tpots),
                  1.0 + accepted / drafts if drafts else 1.0, requests=len(replies))


def scrape_step_phases(port: int) -> dict[str, tuple[float, float]]:
    """The verifier's specd:step_duration_seconds histogram: {phase: (sum seconds, count)}, its
    CUDA-graph capture counters as {"captures": (seconds, count)} and its admission forwards as
    {"prefills": (static, eager)}."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list[float]] = {"captures": [0.0, 0.0], "prefills": [0.0, 0.0]}
    for line in text.splitlines():
        if line.startswith('specd:prefill_forwards_total{path="'):  # [static, eager]
            out["prefills"][line.startswith('specd:prefill_forwards_total{path="eager"')] = float(line.rsplit(" ", 1)[1])
        if line.startswith("specd:cuda_graph_capture_seconds_total "):
            out["captures"][0] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("specd:cuda_graph_captures_total "):
            out["captures"][1] = float(line.rsplit(" ", 1)[1])
        for metric, label, key in (("specd:step_duration_seconds", "phase", ""),
                                   ("specd:drafter_round_trip_seconds", "part", ROUND_TRIP),
                                   ("specd:verify_forward_device_seconds", "batch", FORWARD)):
            for suffix, slot in (("_sum", 0), ("_count", 1)):
                prefix = f"{metric}{suffix}{{{label}=\""
                if line.startswith(prefix):
                    name = key + line[len(prefix):line.index('"', len(prefix))]
                    out.setdefault(name, [0.0, 0.0])[slot] = float(line.rsplit(" ", 1)[1])
    return {phase: (v[0], v[1]) for phase, v in out.items()}


ROUND_TRIP = "round trip "  # scrape keys of the drafter round trip's parts (mean ms per round trip)
ROUND_TRIP_PARTS = ("queued", "transit", "handle", "waited")
SEND_PARTS = ("to_host", "encode", "write")  # the round trip's send, on the verifier's engine thread
FORWARD = "forward "  # scrape keys of the verify forward's own device time by batch kind (mean ms per forward)
FORWARD_KINDS = ("staged", "unstaged")


def step_split_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds per verifier step between two scrapes, by phase, the step count, and the
    CUDA graphs captured meanwhile (a capture inside a timed round stalls it: count and seconds)."""
    before, after = dict(before), dict(after)
    c0, c1 = before.pop("captures", (0.0, 0.0)), after.pop("captures", (0.0, 0.0))
    p0, p1 = before.pop("prefills", (0.0, 0.0)), after.pop("prefills", (0.0, 0.0))
    phases = [p for p in after if not p.startswith((ROUND_TRIP, FORWARD))]
    steps = max((after[p][1] - before.get(p, (0, 0))[1] for p in phases), default=0)
    split = {p: round((after[p][0] - before.get(p, (0, 0))[0]) / steps * 1e3, 3) if steps else 0.0
             for p in phases}
    for p in after:  # the drafter round trip's parts: per round trip; the forward's kinds: per forward
        if p.startswith((ROUND_TRIP, FORWARD)):
            n = after[p][1] - before.get(p, (0, 0))[1]
            split[p] = round((after[p][0] - before.get(p, (0, 0))[0]) / n * 1e3, 3) if n else 0.0
            if p.startswith(FORWARD):
                split[p + " n"] = int(n)
    return split | {"steps": int(steps), "captures": int(c1[1] - c0[1]), "capture_s": round(c1[0] - c0[0], 3),
                    "prefills": int(sum(p1) - sum(p0)), "eager_prefills": int(p1[1] - p0[1])}


# A/B variants of a method, as suffixes of its name ("replay-sync": replay with SPECD_DRAFT_AHEAD=0),
# each from a registered setting's `variants` (specd/settings.py; docs/settings.md lists what each
# setting does). "-trace" traces the verifier's steps 100-139 under SPECD_TRACE_DIR (default
# ./traces, one folder per method; bench/trace_summary.py sums them up: at batch 1 these steps fall
# in the second and third timed rounds); "-dtrace" the drafter's, host ops and named ranges included
# (pair it with --e2e-batches 128 to trace that batch).
VARIANTS = settings.bench_variants()


def base_method(label: str) -> tuple[str, dict]:
    """("replay-sync") -> ("replay", {"SPECD_DRAFT_AHEAD": "0"}): the method and its variants'
    env; suffixes combine ("replay-nostage-nopdl"). A trailing "#N" names another stack of the
    same method ("replay-stage#2"): stacks of one method differ by several percent, so an A/B
    within that needs each side twice, interleaved."""
    label = label.partition("#")[0]
    env: dict = {}
    while True:
        suffix = next((s for s in VARIANTS if label.endswith(s)), None)
        if suffix is None:
            return label, env
        label, env = label.removesuffix(suffix), VARIANTS[suffix] | env


def _captured(row: E2ERow) -> bool:
    return bool(row.step_ms and row.step_ms.get("captures"))


def median_round(timed: list[tuple]) -> tuple:
    """The round of median tokens/s among those without a CUDA-graph capture, of (row, replies)
    pairs sorted by tokens/s; among all of them when every round captured. Why: the verifier
    captures a graph the first time a (batch bucket, tokens per sequence, context width bucket)
    comes up, ~0.5 s at 8B, once in the server's life; which round meets a new width depends on
    how the batch happens to be admitted, so a capture lands in some timed rounds despite the
    warm-up and can take a fifth of a 2.5 s round. Host work on the step's critical path still
    makes single rounds vary by 15-25%, hence a median; every round is listed in the row."""
    steady = [t for t in timed if not _captured(t[0])] or timed
    return steady[len(steady) // 2]


def run_method(method: str, target: Path, draft: Path | None, batches: list[int], prompts, max_tokens: int,
               k: int, device: str, extra_env: dict | None = None, log_level: str = "warning",
               rounds: int = 3, min_requests: int = 1, drafter_device: str | None = None
               ) -> tuple[list[E2ERow], dict]:
    """Per batch size: one warm-up round, then timed rounds until `rounds` of them captured no CUDA
    graph (at most 2 * rounds); the row is the median round of those (median_round). A round is
    waves_for(batch, min_requests) waves of `batch` requests (prompts holds enough of them)."""
    from services.launcher.supervisor import Stack, StackConfig
    from specd.transport.ports import free_port

    # "-fixed": adaptive draft lengths off (--no-speculative-adaptive), k drafts every step.
    label, (method, variant_env) = method, base_method(method.replace("-fixed", ""))
    spec = None if method == "off" else method
    extra_env = dict(extra_env or {}, **variant_env)
    trace_dir = None
    if "SPECD_TRACE_STEPS" in extra_env or "SPECD_DRAFTER_TRACE_STEPS" in extra_env:
        trace_dir = Path(os.environ.get("SPECD_TRACE_DIR", "traces")).resolve() / label
        extra_env["SPECD_TRACE_DIR"] = str(trace_dir)
    metrics_port = free_port()
    config = StackConfig(model=str(target), server_name="127.0.0.1", server_port=free_port(),
                         grpc_port=free_port(), speculative_algorithm=spec,
                         speculative_draft_model=str(draft) if draft else None,
                         speculative_num_draft_tokens=k, speculative_adaptive="-fixed" not in label,
                         max_batch_size=max(batches), device=device,
                         drafter_device=drafter_device, log_level=log_level, extra_env=dict(extra_env or {}), enable_metrics=True,
                         verifier_metrics_port=metrics_port)
    stack = Stack(config)
    rows, outputs, start_s = [], {}, None
    try:  # start inside the try: a stack that fails to start still stops what it started
        t0 = time.perf_counter()
        stack.start(timeout=600)
        start_s = time.perf_counter() - t0
        for batch in batches:
            waves = waves_for(batch, min_requests)
            generate_waves(stack, prompts, batch, waves, max_tokens)  # warm-up: graph captures
            timed = []
            while len(timed) < 2 * rounds and sum(not _captured(t[0]) for t in timed) < rounds:
                before = scrape_step_phases(metrics_port)
                wall, replies = generate_waves(stack, prompts, batch, waves, max_tokens)
                row = _row(label, batch, wall, replies)
                row.step_ms = step_split_ms(before, scrape_step_phases(metrics_port))
                timed.append((row, replies))
            timed.sort(key=lambda t: t[0].tokens_per_s)
            row, replies = median_round(timed)
            row.rounds_tokens_per_s = [round(t[0].tokens_per_s, 1) for t in timed]
            row.rounds_captures = [t[0].step_ms.get("captures", 0) for t in timed]
            rows.append(row)
            for p, r in zip(prompts[:batch * waves], replies):
                outputs[tuple(p)] = list(r.token_ids)
            print(format_row(rows[-1]), flush=True)
    finally:
        stack.stop()
    if trace_dir is not None:
        print(_trace_summary(trace_dir), flush=True)
    return rows, {"stack_start_s": round(start_s, 1), "outputs": outputs}


def _trace_summary(trace_dir: Path) -> str:
    """The traced verifier's graph launches and the traced drafter's step ranges
    (bench/trace_summary.py), also written beside the traces."""
    from bench.trace_summary import graph_launches, load_events, step_ranges_table, summary_table
    from specd.step_trace import DRAFTER_TRACE_FILE, TRACE_FILE

    tables = []
    for name, summarize in ((TRACE_FILE, lambda ev: summary_table(graph_launches(ev))),
                            (DRAFTER_TRACE_FILE, step_ranges_table)):
        path = trace_dir / name
        if path.exists():
            tables.append(f"trace {path}:\n\n" + summarize(load_events(str(path))))
    if not tables:
        return f"trace: none written in {trace_dir} (fewer steps than the window's end?)"
    table = "\n\n".join(tables)
    (trace_dir / "summary.md").write_text(table)
    return table


# The verifier's loop by phase (services/verifier/metrics.py): draft and verify are the engine's
# verbs (host time: the forward runs on the device meanwhile; launch is verify's part before the
# forward is queued, on the critical path), device_wait the commit's wait for the
# device, commit the rest of the commit (of it: sending the next step's draft requests ahead, and
# staging the next verify batch), emit the result writes, prefill
# the admitted requests' forward and first tokens, rest the stream read, deadlines, the loop.
STEP_PHASES = ("draft", "verify", "launch", "device_wait", "commit", "emit", "prefill", "rest")
HEADER = ("| method | batch | output tokens | wall s | tokens/s (rounds) | TPOT ms | acceptance length "
          "(expected) | tokens/s vs off | verifier ms per step: draft / verify (of it: launch) / device wait / "
          "commit (of it: sending the next drafts' requests / staging the next verify) / emit / prefill / "
          "rest (steps; prefill forwards, of them eager; graphs captured in each "
          "timed round, when any; remote drafters: a round trip's queued / transit / drafter (of it: its "
          "proposer's call) / waited ms, its "
          "send's rows to the host / messages built / written ms; the "
          "device's clock from the verify step's start to its forward's launch / end / its sampling's end; the "
          "host's ms in the launch mark; the forward's own device time, launch to end, staged / unstaged "
          "batches (forwards)) |")


def _of_it(step_ms: dict, phase: str) -> str:
    """A phase's parts, where the verifier reports them: verify's launch, commit's send / stage."""
    parts = {"verify": ("launch",), "commit": ("send_ahead", "stage")}.get(phase, ())
    if not parts or not all(p in step_ms for p in parts):
        return ""
    return " (" + " / ".join(f"{step_ms[p]:.2f}" for p in parts) + ")"


def format_row(r: E2ERow) -> str:
    expected = f" ({r.expected_acceptance_length:.2f})" if r.expected_acceptance_length is not None else ""
    speedup = f"{r.speedup_vs_off:.2f}x" if r.speedup_vs_off is not None else "-"
    rounds = f" ({', '.join(f'{v:.0f}' for v in r.rounds_tokens_per_s)})" if r.rounds_tokens_per_s else ""
    captures = (f"; captures {', '.join(map(str, r.rounds_captures))}" if r.rounds_captures and any(r.rounds_captures)
                else "")
    prefills = (f"; prefills {r.step_ms['prefills']}, eager {r.step_ms.get('eager_prefills', 0)}"
                if r.step_ms and r.step_ms.get("prefills") else "")
    round_trip = ""
    if r.step_ms and any(r.step_ms.get(ROUND_TRIP + p) for p in ROUND_TRIP_PARTS):
        parts = [f"{r.step_ms.get(ROUND_TRIP + p, 0):.2f}" for p in ROUND_TRIP_PARTS]
        if ROUND_TRIP + "propose" in r.step_ms:  # the drafter's own time, then its proposer's share
            parts[2] += f" ({r.step_ms[ROUND_TRIP + 'propose']:.2f})"
        round_trip = "; round trip " + " / ".join(parts)
        if any(ROUND_TRIP + p in r.step_ms for p in SEND_PARTS):
            round_trip += "; its send " + " / ".join(f"{r.step_ms.get(ROUND_TRIP + p, 0):.2f}" for p in SEND_PARTS)
    device = ""
    if r.step_ms and r.step_ms.get("device_step"):
        device = (f"; device clock: launch {r.step_ms.get('device_launch', 0):.2f} / forward "
                  f"{r.step_ms['device_forward']:.2f} / step {r.step_ms['device_step']:.2f}"
                  f"; host in the launch mark {r.step_ms.get('launch_mark', 0):.2f}")
        kinds = [f"{k} {r.step_ms[FORWARD + k]:.2f} ({r.step_ms[FORWARD + k + ' n']})" for k in FORWARD_KINDS
                 if r.step_ms.get(FORWARD + k + " n")]
        device += "; forward's own, by batch: " + " / ".join(kinds) if kinds else ""
    split = ("-" if not r.step_ms else
             " / ".join(f"{r.step_ms.get(p, 0):.2f}" + _of_it(r.step_ms, p) for p in STEP_PHASES if p != "launch")
             + f" ({r.step_ms.get('steps', 0)}{prefills}{captures}{round_trip}{device})")
    return (f"| {r.method} | {r.batch} | {r.output_tokens} | {r.wall_s:.2f} | {r.tokens_per_s:.1f}{rounds} | "
            f"{r.tpot_ms:.2f} | {r.acceptance_length:.2f}{expected} | {speedup} | {split} |")


def run_e2e_bench(target: Path, drafts: dict, methods: list[str], batches: list[int],
                  max_tokens: int, k: int, device: str, replay_acceptance: float, work_dir: Path,
                  vocab_for_prompts: int, on_row=None,
                  min_requests: int = 1, drafter_device: str | None = None) -> tuple[list[E2ERow], dict]:
    """Every method over every batch size; "off" always runs first (references, baseline). A round
    at batch B sends at least min_requests requests, in waves of B (waves_for). drafter_device:
    where the drafters run (None: the verifier's device, the drafter then takes a tenth of it).
    """
    from specd.proposers.replay import corrupt_rate_for, write_references

    methods = ["off"] + [m for m in methods if m != "off"]
    prompts = make_prompts(max(b * waves_for(b, min_requests) for b in batches), vocab_for_prompts)
    rows: list[E2ERow] = []
    info: dict = {"k": k, "max_tokens": max_tokens, "device": device, "stack_start_s": {},
                  "drafter_device": drafter_device or device,
                  "min_requests": min_requests,
                  "pdl": os.environ.get("SPECD_PDL", "default")}
    off: dict[int, E2ERow] = {}
    for method in methods:
        env, expected = {}, None
        if base_method(method.replace("-fixed", ""))[0] == "replay":
            refs = work_dir / "replay_references.jsonl"
            write_references(refs, [(list(p), out) for p, out in info["off_outputs"].items()])
            rate = corrupt_rate_for(replay_acceptance, k)
            env |= {"SPECD_REPLAY_REFERENCES": str(refs), "SPECD_REPLAY_CORRUPT_RATE": repr(rate)}
            expected = replay_acceptance
            info["replay_corrupt_rate"] = rate
        draft = drafts.get(base_method(method.replace("-fixed", ""))[0])
        draft = draft() if callable(draft) else draft  # written on first use (the 8B suite's heads)
        method_rows, extra = run_method(method, target, draft, batches, prompts, max_tokens, k, device, env,
                                        min_requests=min_requests, drafter_device=drafter_device)
        info["stack_start_s"][method] = extra["stack_start_s"]
        if method == "off":
            info["off_outputs"] = extra["outputs"]
        for r in method_rows:
            if method == "off":
                off[r.batch] = r
            r.expected_acceptance_length = expected
            r.speedup_vs_off = r.tokens_per_s / off[r.batch].tokens_per_s if r.batch in off else None
            rows.append(r)
        if on_row is not None:
            on_row(rows, info)
    return rows, info


def write_e2e_results(rows: list[E2ERow], info: dict, out_dir: Path) -> str:
    lines = [f"end to end through the services, k = {info['k']}, {info['max_tokens']} output tokens per "
             f"request (greedy, ignore_eos), a round at least {info.get('min_requests', 1)} requests in waves "
             f"of the batch, device {info['device']} (drafters: {info.get('drafter_device', info['device'])}), "
             f"SPECD_PDL {info.get('pdl', 'default')}; stack start s: {info['stack_start_s']}",
             "", HEADER, "|---|---|---|---|---|---|---|---|---|"]
    lines += [format_row(r) for r in rows]
    table = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "e2e.md").write_text(table)
    public = {k: v for k, v in info.items() if k != "off_outputs"}
    (out_dir / "e2e.json").write_text(json.dumps({"info": public, "rows": [asdict(r) for r in rows]}, indent=1))
    return table
