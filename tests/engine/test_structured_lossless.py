"""Structured output under speculation: constrained greedy output with speculation equals
constrained output without it, token for token, for every method; finished JSON validates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specd.engine.builder import build_engine
from specd.grammar.backend import GrammarSpec
from specd.grammar.compiler import GrammarCompilerCache
from specd.grammar.local import LocalGrammarBackend
from specd.messages import PytorchEngineConfig, SpeculativeConfig
from specd.models.loader import load_tokenizer
from specd.proposers.draft_constraints import DraftConstraints
from specd.sampling_params import SamplingParams

from tests.conftest import JSONSCHEMABENCH as BENCH  # noqa: E402
SCHEMA_FILES = ["Github_easy/o10298.json", "Github_trivial/o12256.json", "Glaiveai2K/analyze_health_data_4ad104b4.json"]
METHODS = {
    "eagle3": ("target-llama", "draft-eagle3"),
    "draft_model": ("target-llama", "draft-llama-small"),
    "ngram": ("target-llama", None),
    "deepseek_mtp": ("target-deepseek-mtp", None),
    "qwen3_5_mtp": ("target-qwen3_5-mtp", None),
}


def grammars() -> list[GrammarSpec]:
    specs = [GrammarSpec("json_object"), GrammarSpec("regex", r"(yes|no|maybe)( [0-9]{1,3})?"),
             GrammarSpec("ebnf", 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+ | [0-9]+')]
    for name in SCHEMA_FILES:
        specs.append(GrammarSpec("json_schema", (BENCH / name).read_text()))
    return specs


def constrained_engine(target, spec, draft_masking=True, num_gpu_blocks: int = 0):
    cache = GrammarCompilerCache.from_model_dir(target)
    engine = build_engine(target, PytorchEngineConfig(max_batch_size=8, block_size=16, num_gpu_blocks=num_gpu_blocks),
                          spec, grammar_backend=LocalGrammarBackend(cache))
    if draft_masking and engine.proposer is not None:
        engine.proposer.draft_constraints = DraftConstraints(cache)
    return engine


def check_valid(tokenizer, spec: GrammarSpec, seq) -> bool:
    """Finished outputs must match their grammar; returns whether this one finished."""
    if seq.finish_reason != "stop":
        return False
    text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    if spec.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec.source))
    return True


@pytest.mark.parametrize("method", list(METHODS))
def test_constrained_speculative_equals_constrained_target(tiny_models, method):
    target_name, draft_name = METHODS[method]
    target = tiny_models[target_name]
    specs = grammars()
    prompts = [[5 + i, 9, 13 + 2 * i] * (1 + i % 2) for i in range(len(specs))]
    params = [SamplingParams(max_new_tokens=48) for _ in specs]
    want = constrained_engine(target, None).generate(prompts, params, specs)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3,
                             model=str(tiny_models[draft_name]) if draft_name else "")
    got = constrained_engine(target, spec).generate(prompts, params, specs)
    tokenizer = load_tokenizer(target)
    finished = 0
    for g, w, s in zip(got, want, specs):
        assert g.output_token_ids == w.output_token_ids, f"{method} {s.kind}: constrained outputs differ"
        finished += check_valid(tokenizer, s, g)
    assert sum(s.stats.num_draft_tokens for s in got) > 0
    assert finished >= 1, "no constrained output finished within the token budget"


@pytest.mark.parametrize("method", ["eagle3", "deepseek_mtp", "qwen3_5_mtp"])
def test_mixed_batch_drafts_as_apart(tiny_models, method):
    """Constrained and unconstrained greedy sequences in one batch: the draft heads draft the
    unconstrained ones on the device path and the constrained ones through the grammar, apart.
    Each output equals the target's own, and each sequence drafts and accepts exactly as in a
    batch of its own kind (a draft misrouted by the split would change those counts). Fixed k:
    adaptive lengths are chosen for the whole batch, so they differ with its company."""
    target_name, draft_name = METHODS[method]
    target = tiny_models[target_name]
    specs = [s for g in grammars()[:4] for s in (g, None)]  # constrained, unconstrained, ...
    prompts = [[6 + i, 9, 14 + i] for i in range(len(specs))]
    params = [SamplingParams(max_new_tokens=32) for _ in specs]
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, adaptive=False,
                             model=str(tiny_models[draft_name]) if draft_name else "")
    want = constrained_engine(target, None).generate(prompts, params, specs)
    got = constrained_engine(target, spec).generate(prompts, params, specs)
    apart = {}
    for parity in (0, 1):
        idx = list(range(parity, len(specs), 2))
        seqs = constrained_engine(target, spec).generate([prompts[i] for i in idx], [params[i] for i in idx],
                                                         [specs[i] for i in idx])
        apart.update(zip(idx, seqs))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.output_token_ids == w.output_token_ids, f"{method} seq {i} ({specs[i]}): outputs differ"
        counts = (g.stats.num_draft_tokens, g.stats.num_accepted_tokens)
        assert counts == (apart[i].stats.num_draft_tokens, apart[i].stats.num_accepted_tokens), f"seq {i}"
    assert sum(s.stats.num_accepted_tokens for s in got) > 0


def test_draft_masking_keeps_drafts_inside_the_grammar(tiny_models):
    """With draft masking every n-gram/neural draft the verifier sees is grammatical, so more
    drafts survive than without; the output is the same either way."""
    target, draft = tiny_models["target-llama"], tiny_models["draft-llama-small"]
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model=str(draft))
    specs = grammars()
    prompts = [[7, 8, 9, 10 + i] for i in range(len(specs))]
    params = [SamplingParams(max_new_tokens=40) for _ in specs]
    on = constrained_engine(target, spec, draft_masking=True).generate(prompts, params, specs)
    off = constrained_engine(target, spec, draft_masking=False).generate(prompts, params, specs)
    assert [s.output_token_ids for s in on] == [s.output_token_ids for s in off]
    accepted_on = sum(s.stats.num_accepted_tokens for s in on)
    accepted_off = sum(s.stats.num_accepted_tokens for s in off)
    print(f"accepted drafts: masking on {accepted_on}, off {accepted_off}")
    assert accepted_on >= accepted_off


def test_sampled_constrained_output_stays_valid(tiny_models):
    target, draft = tiny_models["target-llama"], tiny_models["draft-eagle3"]
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, model=str(draft))
    specs = grammars()
    prompts = [[11, 12, 13 + i] for i in range(len(specs))]
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=48, seed=i) for i in range(len(specs))]
    seqs = constrained_engine(target, spec).generate(prompts, params, specs)
    tokenizer = load_tokenizer(target)
    for s, g in zip(seqs, specs):
        check_valid(tokenizer, g, s)  # raises on an invalid finished output
