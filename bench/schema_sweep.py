"""The 600-schema sweep: every jsonschemabench schema through the gateway's check and the engine.

For each schema the gateway's own validation (Gateway.check_values and check_response_format)
decides up front: a GatewayError(400) is a rejection. Every schema it accepts is generated through
the in-process engine (draft masking on, k = 3) under each configuration, greedy and sampled
(temperature 1, a fixed seed per schema), and every output is parsed (strict json.loads) and
validated with `jsonschema` (bench/schema_validation.py, formats checked).

Outcomes: valid; invalid (not JSON, or not valid against the schema); unfinished (finish_reason
"length": what budget-aware closing, specd/grammar/budget.py, prevents); crash (an exception
anywhere but a 400). "closed" counts the responses that closing shaped.

    .venv/bin/python bench/schema_sweep.py                    # all six configurations
    .venv/bin/python bench/schema_sweep.py --configs off ngram --limit 50
    .venv/bin/python bench/schema_sweep.py --configs qwen3_5_mtp --schemas Github_easy/o83161
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.schema_validation import judge, validator_for  # noqa: E402  (after the path setup)
from bench.shared_data import jsonschemabench_dir  # noqa: E402

SCHEMAS = jsonschemabench_dir()
MODELS = ROOT / "models"
K = 3
MAX_TOKENS = 384  # see BENCHMARKS.md, "Structured output: the 600-schema sweep"
MAX_SCHEMA_CHARS = 240  # of the schema text quoted in the prompt (prefill is most of the CPU time)
MAX_BATCH_SIZE = 128
CHUNK = 128  # requests per engine.generate call after a crash (to name the culprit)
SAMPLED_SEED = 1_000_003
SYSTEM = "You are a helpful assistant. Answer with a single JSON value and nothing else."


@dataclass(frozen=True)
class SweepConfig:
    """One way of serving: a target, and a speculative method with its draft (None: none)."""

    name: str
    target: Path
    method: str | None = None
    draft: Path | None = None


def default_configs(models: Path = MODELS, tiny: Path | None = None) -> list[SweepConfig]:
    """off, eagle3, deepseek_mtp, draft_model, ngram on the trained target; qwen3_5_mtp on the tiny one."""
    target = models / "specd-py-target"
    tiny = Path(tiny or os.environ.get("SPECD_TINY_MODELS") or ROOT / ".tiny-models")
    return [SweepConfig("off", target),
            SweepConfig("eagle3", target, "eagle3", models / "specd-py-eagle3"),
            SweepConfig("deepseek_mtp", target, "deepseek_mtp", models / "specd-py-mtp"),
            SweepConfig("draft_model", target, "draft_model", models / "specd-py-draft"),
            SweepConfig("ngram", target, "ngram"),
            SweepConfig("qwen3_5_mtp", tiny / "target-qwen3_5-mtp", "qwen3_5_mtp")]


# ---- the gateway's verdict ----------------------------------------------------------------
def response_format_of(schema_text: str, name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": json.loads(schema_text), "strict": True}}


class GatewayCheck:
    """The gateway's own checks on a request's response_format (no Redis is contacted)."""

    def __init__(self, model: Path) -> None:
        from services.gateway.core import Gateway, GatewayConfig

        self.gateway = Gateway(GatewayConfig(model=str(model)))

    def rejection(self, response_format: dict) -> str | None:
        """The 400's message, or None when the gateway would queue the request.

        Anything but a GatewayError(400) propagates: that is a crash, not a rejection.
        """
        from services.gateway.errors import GatewayError

        try:
            self.gateway.check_values({"response_format": response_format})
            asyncio.run(self.gateway.check_response_format(response_format))
        except GatewayError as e:
            if e.status != 400:
                raise
            return e.message
        return None

    def prompt(self, schema_text: str) -> list[int]:
        """The chat-template prompt asking for JSON for the schema (the schema quoted, cut short)."""
        quoted = schema_text if len(schema_text) <= MAX_SCHEMA_CHARS else schema_text[:MAX_SCHEMA_CHARS] + " ..."
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Give me JSON that follows this JSON schema:\n{quoted}"}]
        return asyncio.run(self.gateway.encode_chat(messages))

    def close(self) -> None:
        self.gateway._tokenize_pool.shutdown(wait=False)


# ---- generation -----------------------------------------------------------------------------
@dataclass
class Case:
    """One schema the gateway accepted, with its prompt."""

    name: str
    schema: object
    source: str  # the GrammarSpec source the gateway compiled
    prompt: list[int]
    validator: object = None
    position: int = 0  # among all the schemas, sorted: the sampled seed is SAMPLED_SEED + position


@dataclass
class ConfigReport:
    """What one configuration did over the sweep."""

    name: str
    counts: dict[str, Counter] = field(default_factory=lambda: {"greedy": Counter(), "sampled": Counter()})
    problems: list[tuple[str, str, str, str, str]] = field(default_factory=list)  # mode, name, outcome, detail, text
    closed: Counter = field(default_factory=Counter)  # mode -> responses budget-aware closing ended
    seconds: float = 0.0
    num_output_tokens: int = 0
    num_steps: int = 0
    mean_acceptance_length: float = 0.0
    max_output_tokens: int = 0


def build(config: SweepConfig, cache, session_len: int):
    from specd.engine.builder import build_engine
    from specd.grammar.local import LocalGrammarBackend
    from specd.messages import PytorchEngineConfig, SpeculativeConfig
    from specd.proposers.draft_constraints import DraftConstraints

    spec = None
    if config.method is not None:
        spec = SpeculativeConfig(method=config.method, num_speculative_tokens=K,
                                 model=str(config.draft) if config.draft else "")
    engine = build_engine(config.target, PytorchEngineConfig(max_batch_size=MAX_BATCH_SIZE, block_size=16,
                                                             session_len=session_len),
                          spec, grammar_backend=LocalGrammarBackend(cache))
    if engine.proposer is not None:
        engine.proposer.draft_constraints = DraftConstraints(cache)
    return engine


def run_config(config: SweepConfig, cases: list[Case], tokenizer, cache, *, max_tokens: int = MAX_TOKENS,
               modes: tuple[str, ...] = ("greedy", "sampled"), sampled_stride: int = 1,
               log=print) -> ConfigReport:
    """Generate every case in every mode under one configuration and judge each output.

    sampled_stride: sampled requests for every n-th case only (greedy: every case).
    """
    from specd.grammar.backend import GrammarSpec
    from specd.messages import SpecStats
    from specd.sampling_params import SamplingParams

    report = ConfigReport(config.name)
    requests = [(mode, i) for i in range(len(cases)) for mode in modes
                if mode == "greedy" or i % sampled_stride == 0]
    session_len = max(len(c.prompt) for c in cases) + max_tokens + K + 1
    stats = SpecStats()
    t0 = time.perf_counter()
    engine = build(config, cache, session_len)

    def params(mode: str, i: int) -> SamplingParams:
        if mode == "greedy":
            return SamplingParams(max_new_tokens=max_tokens)
        return SamplingParams(temperature=1.0, seed=SAMPLED_SEED + cases[i].position, max_new_tokens=max_tokens)

    def record(mode: str, case: Case, outcome: str, detail: str, text: str) -> None:
        report.counts[mode][outcome] += 1
        if outcome != "valid":
            report.problems.append((mode, case.name, outcome, detail, text[:300]))

    def generate(chunk):
        return engine.generate([cases[i].prompt for _, i in chunk], [params(m, i) for m, i in chunk],
                               [GrammarSpec("json_schema", cases[i].source) for _, i in chunk])

    # All requests at once: continuous batching keeps the batch full until the last few.
    try:
        results = generate(requests)
    except Exception:  # noqa: BLE001 - again in chunks, then one by one, on fresh engines
        results = []
        for start in range(0, len(requests), CHUNK):
            chunk = requests[start:start + CHUNK]
            engine = build(config, cache, session_len)
            try:
                results += generate(chunk)
                continue
            except Exception:  # noqa: BLE001
                pass
            for request in chunk:
                engine = build(config, cache, session_len)
                try:
                    results += generate([request])
                except Exception as e:  # noqa: BLE001 - what the sweep counts
                    results.append(e)
    for (mode, i), seq in zip(requests, results):
        if isinstance(seq, Exception):
            record(mode, cases[i], "crash", repr(seq)[:300], "")
            continue
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        outcome, detail = judge(text, seq.finish_reason, cases[i].validator)
        record(mode, cases[i], outcome, detail, text)
        report.closed[mode] += seq.num_closing_tokens > 0
        report.num_output_tokens += seq.num_output_tokens
        report.max_output_tokens = max(report.max_output_tokens, seq.num_output_tokens)
        stats.merge(seq.stats)
    log(f"  {config.name}: {len(requests)} requests, {time.perf_counter() - t0:.0f} s")
    report.seconds = time.perf_counter() - t0
    report.num_steps = engine.stats.num_steps
    report.mean_acceptance_length = stats.mean_acceptance_length if config.method else 1.0
    return report


# ---- the sweep ------------------------------------------------------------------------------
@dataclass
class TargetCases:
    """One target's gateway verdicts: what it compiled and what it refused (with the 400's text)."""

    compiled: list[Case]
    rejected: dict[str, str]  # schema name -> the 400's message
    crashed: dict[str, str]  # schema name -> the exception (a crash of the check itself)
    tokenizer: object
    cache: object


def check_schemas(target: Path, files: list[Path]) -> TargetCases:
    from specd.grammar.compiler import GrammarCompilerCache

    check = GatewayCheck(target)
    compiled, rejected, crashed = [], {}, {}
    # A schema's sampled seed follows its place among all of them, so that a sweep of a few
    # (--schemas, --stride, --limit) samples each as the full sweep does.
    positions = {f"{f.parent.name}/{f.name}": i for i, f in enumerate(schema_files())}
    try:
        for path in files:
            name = f"{path.parent.name}/{path.name}"
            source_text = path.read_text(encoding="utf-8")
            rf = response_format_of(source_text, path.stem)
            try:
                message = check.rejection(rf)
            except Exception as e:  # noqa: BLE001 - what the sweep counts
                crashed[name] = repr(e)[:300]
                continue
            if message is not None:
                rejected[name] = message
                continue
            from specd.grammar.response_format import parse_response_format

            schema = rf["json_schema"]["schema"]
            compiled.append(Case(name, schema, parse_response_format(rf).source, check.prompt(source_text),
                                 validator_for(schema), positions[name]))
        tokenizer = check.gateway.tokenizer
    finally:
        check.close()
    cache = GrammarCompilerCache.from_model_dir(target, max_entries=max(len(files), 1))
    return TargetCases(compiled, rejected, crashed, tokenizer, cache)


def reason_of(message: str) -> str:
    """A rejection's reason, for the table: the feature xgrammar cannot enforce, or the message's gist."""
    m = re.search(r"cannot enforce exactly: (.*?)(?: \(and \d+ more\))?$", message)
    if m:
        return "inexact: " + re.sub(r"\s+", " ", m.group(1)).strip()[:90]
    m = re.search(r"does not support (.*?)(?::|$)", message)
    if m:
        return "unsupported: " + m.group(1)[:90]
    return re.sub(r"\s+", " ", message)[:110]


def schema_files(limit: int | None = None, stride: int = 1, names: list[str] | None = None) -> list[Path]:
    """The jsonschemabench schemas, sorted; every stride-th, the first limit of those.

    names: only these ("Folder/file" or "Folder/file.json", as the reports name them); a name
    that matches no schema is an error, not an empty sweep.
    """
    files = sorted(SCHEMAS.glob("*/*.json"))
    if names is not None:
        wanted = {n if n.endswith(".json") else n + ".json" for n in names}
        by_name = {f"{f.parent.name}/{f.name}": f for f in files}
        unknown = sorted(wanted - by_name.keys())
        if unknown:
            raise ValueError(f"no such schema: {', '.join(unknown)}")
        files = [f for name, f in by_name.items() if name in wanted]
    files = files[::stride]
    return files[:limit] if limit else files


def sweep(configs: list[SweepConfig], files: list[Path], *, max_tokens: int = MAX_TOKENS,
          modes: tuple[str, ...] = ("greedy", "sampled"), sampled_stride: int = 1, log=print):
    """{target: TargetCases}, [ConfigReport]: the gateway's verdicts, then every configuration."""
    targets: dict[Path, TargetCases] = {}
    reports = []
    for config in configs:
        if config.target not in targets:
            t0 = time.perf_counter()
            targets[config.target] = check_schemas(config.target, files)
            tc = targets[config.target]
            log(f"{config.target.name}: compiled {len(tc.compiled)}, rejected {len(tc.rejected)}, "
                f"crashed {len(tc.crashed)} ({time.perf_counter() - t0:.1f} s)")
        tc = targets[config.target]
        reports.append(run_config(config, tc.compiled, tc.tokenizer, tc.cache, max_tokens=max_tokens,
                                  modes=modes, sampled_stride=sampled_stride, log=log))
    return targets, reports


def format_report(targets: dict[Path, TargetCases], reports: list[ConfigReport], seconds: float) -> str:
    lines = []
    for target, tc in targets.items():
        lines.append(f"{target.name}: {len(tc.compiled) + len(tc.rejected) + len(tc.crashed)} schemas, "
                     f"compiled {len(tc.compiled)}, rejected {len(tc.rejected)}, crashes {len(tc.crashed)}")
        for reason, n in Counter(reason_of(m) for m in tc.rejected.values()).most_common():
            lines.append(f"  {n:4d}  {reason}")
    lines.append(f"{'configuration':14}{'mode':>9}{'valid':>7}{'invalid':>9}{'unfinished':>12}{'crashes':>9}"
                 f"{'closed':>8}{'tokens':>9}{'max':>6}{'MAL':>6}{'seconds':>9}")
    for r in reports:
        for mode, c in r.counts.items():
            if not sum(c.values()):
                continue
            lines.append(f"{r.name:14}{mode:>9}{c['valid']:>7}{c['invalid']:>9}{c['unfinished']:>12}"
                         f"{c['crash']:>9}{r.closed[mode]:>8}{r.num_output_tokens:>9}{r.max_output_tokens:>6}"
                         f"{r.mean_acceptance_length:>6.2f}{r.seconds:>9.0f}")
    lines.append(f"total {seconds:.0f} s")
    for r in reports:
        for mode, name, outcome, detail, text in r.problems:
            lines.append(f"  {r.name} {mode} {outcome} {name}: {detail} | {text[:160]!r}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [c.name for c in default_configs()]
    ap.add_argument("--configs", nargs="+", default=names, choices=names)
    ap.add_argument("--limit", type=int, default=None, help="only the first N schemas (sorted)")
    ap.add_argument("--stride", type=int, default=1, help="every N-th schema only")
    ap.add_argument("--schemas", nargs="+", default=None, metavar="FOLDER/FILE",
                    help="only these schemas (e.g. Github_easy/o83161)")
    ap.add_argument("--sampled-stride", type=int, default=1, help="sampled runs for every N-th compiled schema")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    ap.add_argument("--json", type=Path, default=None, help="write the counts and problems here")
    args = ap.parse_args()
    configs = [c for c in default_configs() if c.name in args.configs]
    try:
        files = schema_files(args.limit, args.stride, args.schemas)
    except ValueError as e:
        ap.error(f"--schemas: {e}")
    if any(not c.target.exists() for c in configs):
        from specd.tiny_models.make import make_tiny_models

        make_tiny_models(configs[-1].target.parent)
    t0 = time.perf_counter()
    targets, reports = sweep(configs, files, max_tokens=args.max_tokens,
                             modes=tuple(args.modes), sampled_stride=args.sampled_stride, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_report(targets, reports, time.perf_counter() - t0))
    if args.json:
        args.json.write_text(json.dumps({
            "targets": {t.name: {"compiled": len(tc.compiled), "rejected": tc.rejected, "crashed": tc.crashed}
                        for t, tc in targets.items()},
            "configs": {r.name: {"counts": {m: dict(c) for m, c in r.counts.items()}, "closed": dict(r.closed),
                                 "seconds": r.seconds,
                                 "tokens": r.num_output_tokens, "max_tokens": r.max_output_tokens,
                                 "mal": r.mean_acceptance_length, "problems": r.problems} for r in reports},
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
