"""`python -m bench all --small`: the GPU suite's code at toy size on CPU, every row present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["off", "replay", "replay-sync", "ngram", "eagle3", "draft_model"]  # -sync: drafting ahead off


def test_transformers_twin_shares_weights_and_matches_our_logits():
    from bench.step import arch_config, random_model, transformers_twin
    from specd.messages import PytorchEngineConfig
    from specd.models.base import SequenceChunk
    from specd.models.llama_runner import LlamaRunner

    config = arch_config("small")
    model = random_model(config, torch.float32, torch.device("cpu"))
    hf = transformers_twin(model, config, torch.device("cpu"))
    # Shared storage: transformers' up_proj is the second half of our fused gate_up_proj's rows.
    ours_up = model.model.layers[1].mlp.gate_up_proj.weight
    theirs_up = hf.model.layers[1].mlp.up_proj.weight
    assert theirs_up.untyped_storage().data_ptr() == ours_up.untyped_storage().data_ptr()
    assert torch.equal(theirs_up, ours_up[config.intermediate_size:])
    assert hf.model.layers[0].self_attn.k_proj.weight.untyped_storage().data_ptr() == \
        model.model.layers[0].self_attn.qkv_proj.weight.untyped_storage().data_ptr()
    runner = LlamaRunner(".", PytorchEngineConfig(block_size=8, max_batch_size=2, session_len=64,
                                                  device_type="cpu"), model=model, config=config)
    tokens = [3, 17, 99, 4, 250, 11]
    runner.add_sequence(0)
    ours = runner.forward([SequenceChunk(0, tokens)]).logits
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.slow  # six CPU stacks, ~2 minutes: out of the default run, in CI
def test_small_suite_has_every_row(tmp_path, tiny_models):
    out = tmp_path / "results"
    env = {"SPECD_TINY_MODELS": str(Path(tiny_models["target-llama"]).parent)}
    import os

    proc = subprocess.run([sys.executable, "-m", "bench", "all", "--small", "--out", str(out),
                           "--e2e-batches", "1,2", "--max-tokens", "10", "--methods", ",".join(METHODS),
                           "--e2e-min-requests", "2", "--step-captures", "2"],
                          cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = json.loads((out / "step.json").read_text())
    assert {(r["batch"], r["q"]) for r in step["rows"]} == {(1, 1), (1, 4), (4, 1), (4, 4)}
    for r in step["rows"]:
        assert r["specd_graphs_ms"] > 0 and r["specd_eager_ms"] > 0 and r["transformers_ms"] > 0
        assert r["floor_ms"] > 0
        assert r["specd_staged_ms"] > 0 and r["staged_over_floor"] > 0  # staged as the engine launches it
        each = r["specd_graphs_captures_ms"]  # timed twice, captured anew for the second
        assert len(each) == 2 and r["specd_graphs_ms"] == sorted(each)[1]
    prefill = step["info"]["prefill"]  # the static path's prefill against eager (128 > session: dropped)
    assert [p["tokens"] for p in prefill] == [32] and prefill[0]["graphs_ms"] > 0 and prefill[0]["eager_ms"] > 0
    checks = step["info"]["output_checks"]  # the timed paths compute the same logits
    assert [(c["batch"], c["q"]) for c in checks] == [(1, 4)]
    assert checks[0]["finite"] and checks[0]["pdl_vs_no_pdl_max_abs"] == 0.0
    assert checks[0]["staged_vs_unstaged_max_abs"] == 0.0
    assert checks[0]["kernels_vs_torch_ops_rel_err"] < 1e-4  # float32 on CPU (no Triton there: one body)
    e2e = json.loads((out / "e2e.json").read_text())
    rows = {(r["method"], r["batch"]): r for r in e2e["rows"]}
    assert set(rows) == {(m, b) for m in METHODS for b in (1, 2)}
    for (method, batch), r in rows.items():
        # a round holds at least 2 requests: two waves of one at batch 1, one wave of two at batch 2
        assert r["requests"] == 2
        assert r["output_tokens"] == 10 * 2  # ignore_eos: every request runs to max_tokens
        assert r["tokens_per_s"] > 0 and r["speedup_vs_off"] > 0
        if method == "off":
            assert r["acceptance_length"] == 1.0
        # three timed rounds, the median one reported; the verifier's own step split for it
        assert len(r["rounds_tokens_per_s"]) == 3 and sorted(r["rounds_tokens_per_s"])[1] == round(r["tokens_per_s"], 1)
        assert r["step_ms"]["steps"] > 0 and r["step_ms"]["verify"] > 0
        assert r["rounds_captures"] == [0, 0, 0]  # no CUDA graphs on CPU, so none in a timed round
        assert r["step_ms"]["draft"] > 0 if method != "off" else r["step_ms"]["draft"] >= 0
        # the finer split adds up to "other" (each phase a mean over the same steps)
        parts = sum(r["step_ms"][p] for p in ("device_wait", "commit", "emit", "prefill", "rest"))
        assert r["step_ms"]["prefills"] >= 1  # each timed round admits its requests
        assert r["step_ms"]["device_wait"] > 0 and r["step_ms"]["commit"] > 0 and r["step_ms"]["emit"] > 0
        assert parts == pytest.approx(r["step_ms"]["other"], rel=0.02, abs=0.01)
    assert rows[("replay", 1)]["expected_acceptance_length"] == 3.0
    assert rows[("replay", 1)]["acceptance_length"] > 1.5  # the replayed drafts are accepted
    assert rows[("replay-sync", 1)]["acceptance_length"] > 1.5  # the same drafts, not sent ahead
    summary = (out / "summary.md").read_text()
    assert "| replay | 2 |" in summary and "| 4 | 4 |" in summary


def test_synthetic_target_loads_and_is_decisive(tmp_path):
    """The e2e target (bench/synthetic.py) at toy size: loads through the runner; its greedy next
    token depends on the current token only (so decode and verify kernels cannot disagree)."""
    from bench.step import SHAPES
    from bench.synthetic import write_synthetic_llama
    from specd.messages import PytorchEngineConfig
    from specd.models.base import SequenceChunk
    from specd.models.llama_runner import LlamaRunner

    shape = dict(SHAPES["small"], vocab_size=1024)
    path = write_synthetic_llama(tmp_path / "t", shape, device="cpu", dtype=torch.float32, num_live_tokens=512)
    runner = LlamaRunner(path, PytorchEngineConfig(block_size=8, max_batch_size=2, session_len=64, device_type="cpu"))
    runner.add_sequence(0)
    runner.add_sequence(1)
    out = runner.forward([SequenceChunk(0, [5, 9, 77, 300]), SequenceChunk(1, [40, 2, 77])])
    logits = out.logits
    top2 = logits.topk(2, dim=-1).values
    # margin ~ sqrt(hidden) - max noise: ~8 - 3 here, ~64 - 3 at hidden 4096
    assert (top2[:, 0] - top2[:, 1]).min().item() > 2
    assert logits.argmax(-1).max().item() < 512  # only tokenizer ids are produced
    assert logits[2].argmax() == logits[6].argmax()  # token 77 -> the same next token in both


def test_the_row_is_the_median_of_the_rounds_without_a_graph_capture():
    from bench.e2e import E2ERow, median_round

    def rnd(tokens_per_s, captures):
        return (E2ERow("replay", 128, 1, 1.0, tokens_per_s, 1.0, 3.0, step_ms={"captures": captures}), None)

    timed = sorted([rnd(3863, 1), rnd(5996, 1), rnd(8443, 0), rnd(8300, 0), rnd(8500, 0)],
                   key=lambda t: t[0].tokens_per_s)
    assert median_round(timed)[0].tokens_per_s == 8443  # the captures' rounds are not the steady state
    every_round_captured = [rnd(1000, 1), rnd(2000, 2), rnd(3000, 1)]
    assert median_round(every_round_captured)[0].tokens_per_s == 2000
    assert median_round([rnd(1000, 0), rnd(2000, 0), rnd(3000, 0)])[0].tokens_per_s == 2000


def test_a_round_holds_at_least_min_requests_in_waves_of_the_batch():
    from bench.e2e_rounds import waves_for

    assert [waves_for(b, 8) for b in (1, 2, 3, 7, 8, 64, 128)] == [8, 4, 3, 2, 1, 1, 1]
    assert waves_for(1, 1) == 1
    with pytest.raises(ValueError, match="min_requests"):
        waves_for(1, 0)


def test_method_suffixes_name_their_settings():
    from bench.e2e import base_method

    assert base_method("replay") == ("replay", {})
    assert base_method("replay-grpcsteps") == ("replay", {"SPECD_DRAFTER_FAST_PATH": "0"})
    assert base_method("replay-nostage-nopdl") == ("replay", {"SPECD_STAGE_VERIFY": "0", "SPECD_PDL": "off"})
    assert base_method("replay-stage") == ("replay", {"SPECD_STAGE_VERIFY": "1"})
    assert base_method("replay-stage-trace") == ("replay", {"SPECD_STAGE_VERIFY": "1", "SPECD_TRACE_STEPS": "100:40"})
    assert base_method("replay-stage#2") == ("replay", {"SPECD_STAGE_VERIFY": "1"})  # a second stack
    assert base_method("eagle3-dtrace") == ("eagle3", {"SPECD_DRAFTER_TRACE_STEPS": "100:40"})  # not "-trace"
    assert base_method("off#2") == ("off", {})


def test_the_plan_bench_times_both_paths_over_the_same_batch():
    from bench.plan_lengths import plan_us

    assert plan_us(8, 20, shortcut=False) > 0 and plan_us(8, 20, shortcut=True) > 0
    out = subprocess.run([sys.executable, "-m", "bench.plan_lengths", "--batches", "1,8", "--calls", "10"],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.count("\n| ") == 3 and "| 8 |" in out  # the header and a row per batch
