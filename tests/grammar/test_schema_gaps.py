"""Schema features xgrammar 0.2.9 enforces wrongly without a warning: its grammar accepts a response
that breaks the schema (shown on the raw compile), and the serving compiler refuses the schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specd.grammar.backend import GrammarSpec
from specd.grammar.compiler import GrammarCompileError
from specd.grammar.schema_gaps import find_schema_gaps, regex_has_optional_repetition

# (minimal schema, a response xgrammar's grammar accepts, the words of our refusal)
GAPS = [
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "dependencies": {"a": ["b"]}},
     '{"a": 1}', "'dependencies'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a": 1}', "'if'"),
    ({"type": "string", "not": {"enum": ["x"]}}, '"x"', "'not'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "'uniqueItems'"),
    ({"type": "array", "contains": {"type": "integer"}}, "[]", "'contains'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "7", "anyOf next to type, properties"),
    ({"type": "object", "required": ["a"], "anyOf": [{"properties": {"a": {"enum": [1]}}}]}, "{}",
     "anyOf next to type, required"),
    ({"$defs": {"s": {"type": "string"}}, "type": "object", "required": ["a"],
      "properties": {"a": {"$ref": "#/$defs/s", "maxLength": 2}}}, '{"a": "abcdef"}', "$ref next to maxLength"),
    ({"type": "string", "enum": ["a", 1]}, "1", "enum values outside the declared type 'string'"),
    ({"type": "string", "format": "date", "pattern": "^1"}, '"2024-01-01"', "format next to pattern"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, '{"a": 1}',
     "required property 'b' not declared"),
    ({"type": "string", "pattern": "^y(z*a)?$"}, '"yz"', "an optional group holding a repetition"),
    ({"type": "string", "pattern": "^[a-z]{2,3}(x[a-z]{1,2})?$"}, '"abcd"', "an optional group"),
    ({"type": "object", "patternProperties": {"^y(z+a)?$": {"type": "integer"}}, "minProperties": 1,
      "additionalProperties": False},
     '{"yz": 1}', "an optional group"),
    ({"type": "object", "properties": {"z": {"pattern": "^UTC$"}}}, '{"z": "x"}', "pattern without a type"),
]


def accepts(compiled, text: str, eos_id: int = 1) -> bool:
    """Whether xgrammar's matcher takes the whole text and then the stop token."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text)) and (matcher.is_terminated() or matcher.accept_token(eos_id))


def breaks_schema(text: str, schema) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return True  # raw control characters: not JSON at all
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return not cls(schema).is_valid(value)


@pytest.mark.parametrize("schema,wrong,words", GAPS, ids=[w for _, _, w in GAPS])
def test_xgrammar_accepts_a_wrong_response_and_we_refuse_the_schema(cache, strict_cache, schema, wrong, words):
    spec = GrammarSpec("json_schema", json.dumps(schema))
    assert breaks_schema(wrong, schema), "the response must break the schema"
    assert accepts(cache.compile(spec), wrong), "xgrammar 0.2.9 accepts it (if not, the gap is closed)"
    with pytest.raises(GrammarCompileError) as e:
        strict_cache.validate(spec)
    message = str(e.value)
    assert message.startswith("response_format: the JSON schema uses a feature the grammar engine cannot "
                              "enforce exactly: ")
    assert words in message, message


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "pattern": "^[a-z]+(-[a-z])?$"},  # an optional group, fixed length inside
    {"type": "string", "pattern": "^(ab)*c+$"},
    {"anyOf": [{"type": "string"}, {"type": "integer"}], "description": "annotations are fine"},
    {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"s": {"type": "string"}},
     "$ref": "#/definitions/s", "title": "t"},
    {"type": "integer", "enum": [1, 2]},
    {"type": "object", "properties": {"dependencies": {"type": "string"}, "not": {"type": "integer"}}},
])
def test_exact_schemas_still_compile(strict_cache, schema):
    assert find_schema_gaps(schema) == []
    strict_cache.validate(GrammarSpec("json_schema", json.dumps(schema)))


def test_ref_siblings_are_a_gap_only_where_the_draft_applies_them():
    node = {"definitions": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/definitions/s", "maxLength": 2}}}
    assert any("$ref next to maxLength" in g for g in find_schema_gaps(node))
    # draft-07: $ref replaces its object (validators ignore maxLength there too)
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **node}
    assert not any("$ref" in g for g in find_schema_gaps(draft7))


def test_gaps_name_where_they_are():
    schema = {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}
    assert find_schema_gaps(schema) == ["the keyword 'uniqueItems' (ignored by the grammar engine) (at /properties/x)"]


def test_the_regex_rule_covers_xgrammars_wrong_patterns(cache, allowed_ids):
    """Patterns of every shape found wrong (by a random-pattern probe of xgrammar) are flagged;
    xgrammar's accepted-but-wrong string is shown for each."""
    wrong = [(r"((\d{1,2}|\d{2}[ab])*a)?", "11b"), (r"(a+(\d?ax|\d+){0,2})?", "ax"), (r"(\d+a)?\d(b)", "11b"),
             (r"^y(?:\s*\+(a|b))?$", "y "), (r"^[a-z]{2,3}(-x(-[a-z]{1,2})+)?$", "abcd")]
    for pattern, text in wrong:
        assert not re.fullmatch(pattern, text)
        compiled = cache.compile(GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": pattern})))
        assert accepts(compiled, json.dumps(text)), pattern
        assert regex_has_optional_repetition(pattern), pattern
    for pattern in [r"^y(za)?$", r"^(ab)+$", r"^a*b?$", r"^[0-9]{3}-[0-9]{4}$", r"^(a|b)*$"]:
        assert not regex_has_optional_repetition(pattern), pattern


def test_bounded_strings_are_served_with_control_characters_masked(cache, strict_cache):
    """xgrammar's bounded-string rule admits a raw tab (issue #800): the compiler gives bounded
    strings the character class of its other strings (structural tags, whose free text needs
    newlines, rely on that), and our JSON rows mask every control-character token as well."""
    import xgrammar as xgr

    schema = json.dumps({"type": "string", "maxLength": 3})
    raw = xgr.GrammarCompiler(strict_cache.tokenizer_info).compile_json_schema(
        schema, any_whitespace=False, strict_mode=True)
    assert accepts(raw, '"a\tb"'), "xgrammar 0.2.9 accepts the raw tab"
    spec = GrammarSpec("json_schema", schema)
    assert not accepts(cache.compile(spec), '"a\tb"') and accepts(cache.compile(spec), '"a b"')
    strict_cache.validate(spec)  # not refused
    grammar = strict_cache.sequence_grammar(spec)
    vocab = strict_cache.tokenizer_info.decoded_vocab
    quote = next(i for i, t in enumerate(vocab) if t == b'"')
    a = next(i for i, t in enumerate(vocab) if t == b"a")
    grammar.commit([quote, a])
    row = grammar.next_mask()
    allowed = [i for i in range(strict_cache.vocab_size) if (int(row[i // 32]) >> (i % 32)) & 1]
    assert allowed and not any(any(b < 0x20 for b in vocab[i]) for i in allowed)
    tab = [i for i, t in enumerate(vocab) if b"\t" in t]
    assert tab and not any(grammar.fork_drafts().advance(i) for i in tab)
    assert xgr_row_allows_a_control_token(raw, [quote, a], vocab), "the raw grammar offers them here"


def xgr_row_allows_a_control_token(compiled, prefix, vocab) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for t in prefix:
        assert matcher.accept_token(t)
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    matcher.fill_next_token_bitmask(bitmask)
    return any(((int(bitmask[0, i // 32]) >> (i % 32)) & 1) and any(b < 0x20 for b in vocab[i])
               for i in range(len(vocab)))
