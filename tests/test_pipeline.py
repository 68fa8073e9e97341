"""The seed's pipeline example runs with only the import and the model paths changed."""

import subprocess
import sys
from pathlib import Path

import pytest

from specd import GenerationConfig, PytorchEngineConfig, pipeline
from specd.messages import SpeculativeConfig
from specd.models.model_path import ModelNotFoundError

ROOT = Path(__file__).resolve().parents[1]


def test_seed_example_script_runs(tiny_models):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "pipeline_eagle3.py"),
                          str(tiny_models["target-llama"]), str(tiny_models["draft-eagle3"])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("Response(") == 2 and "spec_stats" in out.stdout


def test_pipeline_responses_carry_spec_stats(tiny_models):
    pipe = pipeline(str(tiny_models["target-llama"]), backend_config=PytorchEngineConfig(max_batch_size=4),
                    speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    responses = pipe(["Hi, pls intro yourself", [{"role": "user", "content": "Shanghai is"}]],
                     gen_config=GenerationConfig(max_new_tokens=12, ignore_eos=True))
    assert len(responses) == 2
    for r in responses:
        assert r.generate_token_len == 12 and r.finish_reason == "length" and isinstance(r.text, str)
        assert r.spec_stats.num_drafts >= 0 and r.input_token_len > 0
    single = pipe("Shanghai is", gen_config=GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert single.generate_token_len == 4


def test_stop_words_end_generation_and_are_cut(tiny_models):
    pipe = pipeline(str(tiny_models["target-llama"]))
    free = pipe("abc", gen_config=GenerationConfig(max_new_tokens=20, ignore_eos=True))
    word = free.text[5:8]
    assert word.strip(), "the target's text should contain a stop word candidate"
    stopped = pipe("abc", gen_config=GenerationConfig(max_new_tokens=20, ignore_eos=True, stop_words=[word]))
    assert stopped.finish_reason == "stop" and word not in stopped.text
    assert free.text.startswith(stopped.text)


def test_missing_hub_id_is_a_clear_error():
    with pytest.raises(ModelNotFoundError, match="does not download"):
        pipeline("meta-llama/Llama-3.1-8B-Instruct")


def test_cli_reports_missing_model_without_traceback():
    out = subprocess.run([sys.executable, "-m", "specd.cli", "generate", "no-such/model"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "specd: error:" in out.stderr and "Traceback" not in out.stderr


def test_pipeline_stays_the_function_after_a_first_call(tiny_models):
    """The in-process module is not named `pipeline`: importing it (as the first call does) once
    replaced specd.pipeline, the function, with the module, and a later `from specd import
    pipeline` got the module (TypeError: 'module' object is not callable)."""
    import specd

    pipe = pipeline(str(tiny_models["target-llama"]), backend_config=PytorchEngineConfig(max_batch_size=1))
    pipe("Hi", gen_config=GenerationConfig(max_new_tokens=2, ignore_eos=True))
    from specd import pipeline as again

    assert callable(again) and again is specd.pipeline and again.__module__ == "specd"


def test_pipeline_returns_logprobs_in_lmdeploys_shape(tiny_models):
    """GenerationConfig(logprobs=N): per output token {token_id: logprob}, the chosen token first,
    the target-only engine's values; none unless asked."""
    from specd.engine.builder import build_engine
    from specd.sampling_params import SamplingParams

    target = str(tiny_models["target-llama"])
    pipe = pipeline(target, backend_config=PytorchEngineConfig(max_batch_size=2),
                    speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    asked, plain = pipe(["import json", "import json"], gen_config=[GenerationConfig(max_new_tokens=8, logprobs=3, ignore_eos=True),
                                                                   GenerationConfig(max_new_tokens=8, ignore_eos=True)])
    assert plain.logprobs is None
    assert len(asked.logprobs) == len(asked.token_ids) == 8
    [seq] = build_engine(target, PytorchEngineConfig(max_batch_size=1)).generate(
        [pipe.encode("import json")], [SamplingParams(max_new_tokens=8, logprobs=3, ignore_eos=True)])
    assert asked.token_ids == seq.output_token_ids
    for got, token, entry in zip(asked.logprobs, seq.output_token_ids, seq.output_logprobs):
        assert next(iter(got)) == token  # the chosen token first
        assert 3 <= len(got) <= 4  # and its top 3 (the chosen among them or not)
        assert abs(got[token] - entry.logprob) <= 1e-4
        assert all(abs(got[t] - lp) <= 1e-4 for t, lp in entry.top)
    only_chosen = pipe("import json", gen_config=GenerationConfig(max_new_tokens=4, logprobs=0, ignore_eos=True))
    assert [list(d) for d in only_chosen.logprobs] == [[t] for t in only_chosen.token_ids]
