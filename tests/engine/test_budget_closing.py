"""Budget-aware closing through the engine (specd/grammar/budget.py): a constrained response that
would run out of max_tokens mid-value ends complete and valid, with finish_reason "stop", and
greedy speculative output still equals non-speculative output token for token under a low budget."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specd.engine.builder import build_engine
from specd.grammar.compiler import GrammarCompilerCache
from specd.grammar.local import LocalGrammarBackend
from specd.grammar.response_format import parse_response_format
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.models.loader import load_tokenizer
from specd.proposers.draft_constraints import DraftConstraints
from specd.sampling_params import SamplingParams

from tests.conftest import JSONSCHEMABENCH as BENCH
from tests.conftest import REPO
from tests.engine.test_structured_lossless import METHODS, check_valid, grammars

MODELS = REPO / "models"
TARGET = MODELS / "specd-py-target"
TRAINED_METHODS = {"eagle3": MODELS / "specd-py-eagle3", "deepseek_mtp": MODELS / "specd-py-mtp",
                   "draft_model": MODELS / "specd-py-draft", "ngram": None}
# o10298: the trained target repeats array items until any budget runs out.
SCHEMA_FILES = ["Github_easy/o10298.json", "Glaiveai2K/analyze_health_data_4ad104b4.json", "Github_easy/o83685.json"]
STRING_SCHEMA = {"type": "object", "properties": {"code": {"type": "string"}, "lines": {
    "type": "array", "items": {"type": "string"}}}, "required": ["code", "lines"]}
SYSTEM = "You are a helpful assistant. Answer with a single JSON value and nothing else."


def engine(target, cache, method=None, draft=None):
    spec = None if method is None else SpeculativeConfig(method=method, num_speculative_tokens=3,
                                                          model=str(draft) if draft else "")
    eng = build_engine(target, PytorchEngineConfig(max_batch_size=8, block_size=16), spec,
                       grammar_backend=LocalGrammarBackend(cache))
    if eng.proposer is not None:
        eng.proposer.draft_constraints = DraftConstraints(cache)
    return eng


@pytest.fixture(scope="module")
def trained():
    """(schemas, specs, chat prompts) for the trained target, as the schema sweep asks."""
    tokenizer = load_tokenizer(TARGET)
    texts = [(BENCH / name).read_text() for name in SCHEMA_FILES] + [json.dumps(STRING_SCHEMA)]
    schemas = [json.loads(t) for t in texts]
    specs = [parse_response_format({"type": "json_schema", "json_schema": {"name": "t", "schema": s, "strict": True}})
             for s in schemas]
    prompts = []
    for text in texts:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Give me JSON that follows this JSON schema:\n{text[:240]}"}]
        chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return schemas, specs, prompts, tokenizer


def assert_complete_and_valid(seqs, schemas, tokenizer):
    for seq, schema in zip(seqs, schemas):
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        assert seq.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("max_tokens", [40, 384])
def test_a_response_that_would_run_out_ends_complete_and_valid(trained, max_tokens):
    schemas, specs, prompts, tokenizer = trained
    params = [SamplingParams(max_new_tokens=max_tokens) for _ in specs]
    no_closing = GrammarCompilerCache.from_model_dir(TARGET, closing=None)
    unclosed = engine(TARGET, no_closing).generate(prompts, params, specs)
    assert unclosed[0].finish_reason == "length"  # the loop: truncated, unparseable JSON
    eng = engine(TARGET, GrammarCompilerCache.from_model_dir(TARGET))
    closed = eng.generate(prompts, params, specs)
    assert_complete_and_valid(closed, schemas, tokenizer)
    assert closed[0].num_closing_tokens > 0 and eng.constraints.num_closed_sequences >= 1
    for before, after in zip(unclosed, closed):  # what ended on its own well within the budget is unchanged
        if before.finish_reason == "stop" and len(before.output_token_ids) < max_tokens // 2:
            assert after.output_token_ids == before.output_token_ids and after.num_closing_tokens == 0


@pytest.mark.parametrize("method", list(TRAINED_METHODS))
def test_closing_is_lossless_under_speculation_trained(trained, method):
    schemas, specs, prompts, tokenizer = trained
    cache = GrammarCompilerCache.from_model_dir(TARGET)
    for max_tokens in (24, 40):
        params = [SamplingParams(max_new_tokens=max_tokens) for _ in specs]
        want = engine(TARGET, cache).generate(prompts, params, specs)
        got = engine(TARGET, cache, method, TRAINED_METHODS[method]).generate(prompts, params, specs)
        assert [g.output_token_ids for g in got] == [w.output_token_ids for w in want], (method, max_tokens)
        assert sum(g.stats.num_draft_tokens for g in got) > 0
        assert [g.num_closing_tokens > 0 for g in got] == [w.num_closing_tokens > 0 for w in want]
    assert any(w.num_closing_tokens for w in want)


@pytest.mark.parametrize("method", list(METHODS))
def test_closing_is_lossless_under_speculation_tiny(tiny_models, method):
    """The tiny random-weight targets wander inside every grammar kind: 24 tokens close them all."""
    target_name, draft_name = METHODS[method]
    target = tiny_models[target_name]
    specs = grammars()
    prompts = [[5 + i, 9, 13 + 2 * i] * (1 + i % 2) for i in range(len(specs))]
    params = [SamplingParams(max_new_tokens=24) for _ in specs]
    cache = GrammarCompilerCache.from_model_dir(target)
    want = engine(target, cache).generate(prompts, params, specs)
    draft = tiny_models[draft_name] if draft_name else None
    got = engine(target, cache, method, draft).generate(prompts, params, specs)
    tokenizer = load_tokenizer(target)
    for g, w, spec in zip(got, want, specs):
        assert g.output_token_ids == w.output_token_ids, f"{method} {spec.kind}: constrained outputs differ"
        assert check_valid(tokenizer, spec, g), f"{method} {spec.kind}: {g.finish_reason}"
    assert sum(s.stats.num_draft_tokens for s in got) > 0 and any(s.num_closing_tokens for s in got)


def test_the_random_qwen_target_closes_inside_a_pattern_that_needs_two_tokens_to_progress(tiny_models):
    """Github_easy/o83161 on the tiny random Qwen3.5 target: every closing walk goes through
    "hasEmail" (`^mailto:...@[\\w.-]+\\.[\\w.-]+?$`), where a walk looking one token ahead
    finds no suffix (closing.py, _progress), and the response runs out of tokens (finish_reason
    "length"). It closes, greedy, and the same under qwen3_5_mtp speculation."""
    target = tiny_models["target-qwen3_5-mtp"]
    schema = json.loads((BENCH / "Github_easy/o83161.json").read_text())
    spec = parse_response_format({"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}})
    cache = GrammarCompilerCache.from_model_dir(target)
    params = [SamplingParams(max_new_tokens=96)]
    want = engine(target, cache).generate([[5, 9, 13]], params, [spec])[0]
    got = engine(target, cache, "qwen3_5_mtp").generate([[5, 9, 13]], params, [spec])[0]
    assert got.output_token_ids == want.output_token_ids
    text = load_tokenizer(target).decode(want.output_token_ids, skip_special_tokens=True)
    assert want.finish_reason == "stop" and want.num_closing_tokens > 0, text
    assert '"hasEmail": "mailto:' in text
    jsonschema.validate(json.loads(text), schema)


def test_sampled_closing_stays_complete_and_valid(trained, tiny_models):
    schemas, specs, prompts, tokenizer = trained
    for max_tokens in (32, 96):
        params = [SamplingParams(temperature=1.0, seed=11 + i, max_new_tokens=max_tokens) for i in range(len(specs))]
        seqs = engine(TARGET, GrammarCompilerCache.from_model_dir(TARGET), "eagle3",
                      TRAINED_METHODS["eagle3"]).generate(prompts, params, specs)
        assert_complete_and_valid(seqs, schemas, tokenizer)
    target = tiny_models["target-llama"]
    specs = grammars()
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=24, seed=i) for i in range(len(specs))]
    seqs = engine(target, GrammarCompilerCache.from_model_dir(target), "eagle3", tiny_models["draft-eagle3"]).generate(
        [[11, 12, 13 + i] for i in range(len(specs))], params, specs)
    tokenizer = load_tokenizer(target)
    assert all(check_valid(tokenizer, spec, s) for spec, s in zip(specs, seqs))


def test_the_budget_sent_with_each_step():
    """Tokens left, stop token included, under max_new_tokens and the context; none while
    min_new_tokens holds the stop tokens back (a forced stop token would be masked out)."""
    from specd.engine.constraints import ConstraintTracker
    from specd.engine.sequence import Sequence

    tracker = ConstraintTracker(None, max_model_len=20)
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_new_tokens=10), output_token_ids=[4, 5])
    assert tracker.budget(seq) == 8
    seq.output_token_ids += [6] * 6  # 11 tokens of 20: the context leaves 9, max_new_tokens 2
    assert tracker.budget(seq) == 2
    assert ConstraintTracker(None).budget(Sequence(0, [1] * 50, SamplingParams(max_new_tokens=10))) == 10
    held = Sequence(0, [1, 2, 3], SamplingParams(max_new_tokens=10, min_new_tokens=4), output_token_ids=[4, 5])
    assert tracker.budget(held) is None
    held.output_token_ids += [6, 7]
    assert tracker.budget(held) == 6
