"""Greedy decoding under a grammar with random logits: outputs parse and validate.

The "model" is random logits with a bias towards closing tokens (quotes, brackets, commas, EOS),
so that unconstrained strings and numbers end after a few tokens; everything else (which tokens
may come next) is the grammar's doing. The speculative test checks that masking along drafts on
the real matchers gives the same output as masking token by token.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from specd.grammar.backend import GrammarSpec, GrammarStep
from specd.grammar.local import LocalGrammarBackend
from specd.grammar.masking import apply_bitmask
from specd.grammar.matcher import SequenceGrammar
from specd.grammar.response_format import parse_response_format

EOS_IDS = (1, 3)
MAX_TOKENS = 1500
DOZEN = ["Github_easy/o12182.json", "Github_easy/o36441.json", "Github_easy/o57387.json",
         "Github_easy/o78036.json", "Github_trivial/o2140.json", "Github_trivial/o65460.json",
         "Glaiveai2K/calculate_age_difference_69307974.json", "Glaiveai2K/calculate_area_5fc9bb9f.json",
         "Glaiveai2K/calculate_area_b99af9e3.json", "Glaiveai2K/calculate_distance_1d43e56b.json",
         "Glaiveai2K/create_calendar_event_d1077992.json", "Glaiveai2K/generate_invoice_c57328a1.json"]


@pytest.fixture(scope="module")
def closing_bias(token_texts) -> torch.Tensor:
    """[V] logit bias: favour tokens that close strings / containers / numbers and EOS."""
    bias = torch.zeros(len(token_texts))
    for i, text in enumerate(token_texts):
        bias[i] += 3.0 * any(c in text for c in '"}],') - 3.0 * any(c in text for c in "{[")
    bias[list(EOS_IDS)] += 20.0
    return bias


def target_logits(prefix: list[int], bias: torch.Tensor) -> torch.Tensor:
    """[1, V] logits, a deterministic function of the prefix (a stand-in for a model)."""
    gen = torch.Generator().manual_seed(hash(tuple(prefix)) % (1 << 31))
    return torch.randn((1, bias.shape[0]), generator=gen) + bias


def greedy(grammar: SequenceGrammar, bias: torch.Tensor) -> list[int] | None:
    """Masked greedy decoding to EOS (None when MAX_TOKENS pass first)."""
    out: list[int] = []
    while len(out) < MAX_TOKENS:
        token = int(apply_bitmask(target_logits(out, bias), grammar.next_mask()[None]).argmax())
        grammar.commit([token])
        out.append(token)
        if token in EOS_IDS:
            return out
    return None


def schema_spec(schema) -> GrammarSpec:
    return parse_response_format({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})


@pytest.mark.parametrize("name", DOZEN)
def test_greedy_output_validates_against_real_schemas(name, cache, tokenizer, closing_bias, load_schema):
    schema = load_schema(name)
    out = greedy(SequenceGrammar(cache.compile(schema_spec(schema))), closing_bias)
    assert out is not None, "did not reach EOS"
    jsonschema.validate(json.loads(tokenizer.decode(out[:-1])), schema)


@pytest.mark.parametrize("rf,check", [
    ({"type": "json_object"}, lambda text: isinstance(json.loads(text), dict)),
    ({"type": "regex_schema", "regex_schema": r"(cat|dog)-[0-9]{2,4}"},
     lambda text: __import__("re").fullmatch(r"(cat|dog)-[0-9]{2,4}", text)),
    ({"type": "ebnf", "ebnf": 'root ::= "yes" | "no" | "maybe" " " [0-9]'},
     lambda text: text in ("yes", "no") or __import__("re").fullmatch("maybe [0-9]", text)),
])
def test_greedy_output_follows_other_grammars(rf, check, cache, tokenizer, closing_bias):
    out = greedy(SequenceGrammar(cache.compile(parse_response_format(rf))), closing_bias)
    assert out is not None and check(tokenizer.decode(out[:-1]))


def speculative_greedy(backend: LocalGrammarBackend, seq_id: int, bias: torch.Tensor,
                       k: int = 4) -> list[int]:
    """Draft k tokens per step on a DraftGrammar, verify them against masked target logits.

    The drafter picks the target's masked choice, except every third draft, where it picks a
    token the grammar forbids; verification accepts drafts while they equal the target's masked
    greedy token and then appends that token (recovered or bonus), as the engine does.
    """
    out: list[int] = []
    commits: list[int] = []
    step_num = 0
    while len(out) < MAX_TOKENS:
        # Commits first: the drafter forks the committed state (in the engine, last step's).
        backend.step(GrammarStep(commits={seq_id: commits}))
        drafter = backend.get(seq_id).fork_drafts()
        drafts: list[int] = []
        for j in range(k):
            row = drafter.next_mask()[None]
            logits = apply_bitmask(target_logits(out + drafts, bias), row)
            token = int(logits.argmax()) if (step_num + j) % 3 else int(logits.argmin())  # -inf: forbidden
            drafts.append(token)
            if not drafter.advance(token):
                break
        step_num += 1
        result = backend.step(GrammarStep(drafts={seq_id: drafts}))[seq_id]
        accepted: list[int] = []
        for j in range(result.num_valid_drafts + 1):
            token = int(apply_bitmask(target_logits(out + drafts[:j], bias), result.bitmask[j:j + 1]).argmax())
            accepted.append(token)
            if token in EOS_IDS or j == len(drafts) or token != drafts[j]:
                break
        out += accepted
        commits = accepted
        if accepted[-1] in EOS_IDS:
            return out
    raise AssertionError("did not reach EOS")


@pytest.mark.parametrize("name", DOZEN[::3])
def test_speculative_masks_give_the_plain_greedy_output(name, cache, closing_bias, load_schema):
    spec = schema_spec(load_schema(name))
    plain = greedy(SequenceGrammar(cache.compile(spec)), closing_bias)
    backend = LocalGrammarBackend(cache)
    backend.open(0, spec)
    assert speculative_greedy(backend, 0, closing_bias) == plain


def test_all_schemas_decode_to_valid_json(schema_files, strict_cache, tokenizer, closing_bias):
    """Every jsonschemabench schema: refused up front, or decoded output parses and validates.

    Schemas xgrammar 0.2.9 only approximates (it warns and ignores a keyword: oneOf read as anyOf,
    minLength next to pattern, multipleOf, ...) or gets wrong silently (schema_gaps.py: dropped
    siblings of anyOf, ignored dependencies, optional regex groups, raw control characters in
    length-bounded strings, ...) are refused by the strict cache.
    """
    from specd.grammar.compiler import GrammarCompileError

    counts = {"valid": 0, "invalid": 0, "control_char": 0, "unfinished": 0, "bad_schema": 0, "refused": 0}
    invalid = []
    for path in schema_files:
        schema = json.loads(path.read_text(encoding="utf-8"))
        try:
            strict_cache.validate(schema_spec(schema))
        except GrammarCompileError as e:
            assert "cannot enforce exactly" in str(e) or "invalid" in str(e), str(e)
            counts["refused"] += 1
            continue
        out = greedy(strict_cache.sequence_grammar(schema_spec(schema)), closing_bias)
        if out is None:
            counts["unfinished"] += 1
            continue
        text = tokenizer.decode(out[:-1])
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            assert "Invalid control character" in str(e), (path.name, text)
            counts["control_char"] += 1
            invalid.append(f"{path.parent.name}/{path.name}: raw control character (xgrammar #800)")
            value = json.loads(text, strict=False)
        try:
            jsonschema.validate(value, schema)
            counts["valid"] += 1
        except jsonschema.SchemaError:
            counts["bad_schema"] += 1  # the schema itself breaks the metaschema
        except jsonschema.ValidationError as e:
            counts["invalid"] += 1
            invalid.append(f"{path.parent.name}/{path.name}: {e.message[:80]}")
    print(f"\ndecoded {len(schema_files)} schemas: {counts}\n  " + "\n  ".join(invalid))
    assert counts["valid"] >= 0.8 * len(schema_files), counts
    # Refusing the approximated schemas took the invalid outputs from 21 to 7; refusing the
    # silent gaps as well (specd/grammar/schema_gaps.py) takes them, and raw control characters, to 0.
    assert counts["invalid"] == 0 and counts["control_char"] == 0, invalid
