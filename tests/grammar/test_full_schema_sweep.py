"""The schema sweep: every jsonschemabench schema is refused up front with a 400 by the gateway's own
check, or every response for it, under every speculative method and without speculation, greedy
and sampled, parses and validates against it with `jsonschema` (bench/schema_sweep.py does the
work; BENCHMARKS.md, "Structured output: the 600-schema sweep", has the figures and the command).

The gateway's verdict covers all 600 schemas. Generation is split to bound the CPU time: on a
2-core CPU one configuration takes ~2-4 minutes per 100 requests (the per-step cost of the 8-layer
target at small batch sizes dominates), so the test generates for every SCHEMA_STRIDE-th schema
(greedy and sampled, every SAMPLED_STRIDE-th of those sampled; 20 schemas by default, ~7 minutes) under all six configurations; the
full sweep is `bench/schema_sweep.py` with no stride, and SPECD_SWEEP_STRIDE=1
runs it here.
Every response must also finish (finish_reason "stop"): the trained 10 M model falls into greedy
repetition loops inside unbounded strings and arrays that no budget ends by itself, and
budget-aware closing (specd/grammar/budget.py) makes the grammar close such a response in time,
so none may come out truncated ("unfinished").
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest

from bench.schema_sweep import MAX_TOKENS, default_configs, format_report, schema_files, sweep

pytestmark = pytest.mark.slow
SAMPLED_STRIDE = int(os.environ.get("SPECD_SWEEP_SAMPLED_STRIDE", "1"))
SCHEMA_STRIDE = int(os.environ.get("SPECD_SWEEP_STRIDE", "30"))  # 1: generate for all 600 schemas


def test_every_schema_is_refused_with_a_400_or_compiles(tiny_models):
    """The gateway's verdict on all 600: a 400 naming the problem, or a compiled grammar."""
    from bench.schema_sweep import check_schemas

    for target in {c.target for c in default_configs(tiny=tiny_models["target-qwen3_5-mtp"].parent)}:
        tc = check_schemas(target, schema_files())
        print(f"\n{target.name}: compiled {len(tc.compiled)}, rejected {len(tc.rejected)}")
        assert len(tc.compiled) + len(tc.rejected) == 600 and not tc.crashed, tc.crashed
        assert all(m.startswith("response_format") and m.split(":", 1)[1].strip() for m in tc.rejected.values())
        assert len(tc.compiled) >= 450  # refusing is the exception


def test_every_schema_is_refused_or_every_response_validates(tiny_models):
    files = schema_files(stride=SCHEMA_STRIDE)
    assert len(files) == -(-600 // SCHEMA_STRIDE)
    configs = default_configs(tiny=tiny_models["target-qwen3_5-mtp"].parent)
    assert [c.name for c in configs] == ["off", "eagle3", "deepseek_mtp", "draft_model", "ngram", "qwen3_5_mtp"]
    start = time.perf_counter()
    targets, reports = sweep(configs, files, sampled_stride=SAMPLED_STRIDE)
    print("\n" + format_report(targets, reports, time.perf_counter() - start))

    for target, tc in targets.items():
        assert not tc.crashed, tc.crashed
        assert len(tc.compiled) + len(tc.rejected) == len(files)
        # every refusal is the gateway's 400 naming the response_format problem
        assert all(message.startswith("response_format") and message.split(":", 1)[1].strip()
                   for message in tc.rejected.values()), tc.rejected
    totals = Counter()
    for r in reports:
        num_cases = len(targets[next(c.target for c in configs if c.name == r.name)].compiled)
        assert sum(r.counts["greedy"].values()) == num_cases
        assert sum(r.counts["sampled"].values()) == -(-num_cases // SAMPLED_STRIDE)
        for counts in r.counts.values():
            totals.update(counts)
    problems = [(r.name, p) for r in reports for p in r.problems]
    assert totals["invalid"] == 0 and totals["crash"] == 0 and totals["unfinished"] == 0, problems
    assert totals["valid"] == sum(totals.values())
    assert sum(sum(r.closed.values()) for r in reports) > 0  # the loops were closed, not cut off
    assert MAX_TOKENS >= 256
