"""response_format parsing: every accepted shape, and readable errors for malformed objects."""

from __future__ import annotations

import json

import pytest

from specd.grammar.backend import GrammarSpec
from specd.grammar.response_format import parse_response_format, spec_from_dict, spec_to_dict
from specd.messages import ConfigError

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_text_and_none_are_unconstrained():
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None


def test_json_object():
    assert parse_response_format({"type": "json_object"}) == GrammarSpec("json_object")


def test_json_schema_keeps_property_order_and_normalises_whitespace():
    spec = parse_response_format({"type": "json_schema",
                                  "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}})
    assert spec.kind == "json_schema"
    assert json.loads(spec.source) == SCHEMA
    assert list(json.loads(spec.source)["properties"]) == ["b", "a"]  # generation order
    as_text = parse_response_format({"type": "json_schema",
                                     "json_schema": {"name": "s", "schema": json.dumps(SCHEMA, indent=4)}})
    assert as_text == spec  # same spec -> same cache entry


def test_json_schema_boolean_schema_and_missing_name():
    assert parse_response_format({"type": "json_schema", "json_schema": {"schema": True}}).source == "true"


@pytest.mark.parametrize("rf,kind,source", [
    ({"type": "regex_schema", "regex_schema": "[a-z]+"}, "regex", "[a-z]+"),
    ({"type": "ebnf", "ebnf": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
    ({"type": "grammar", "grammar": 'root ::= "b"'}, "ebnf", 'root ::= "b"'),
])
def test_lmdeploy_extras(rf, kind, source):
    assert parse_response_format(rf) == GrammarSpec(kind, source)


@pytest.mark.parametrize("rf,field", [
    ([1], "response_format: expected an object"),
    ({}, "response_format.type: missing"),
    ({"type": "yaml"}, "response_format.type: expected one of"),
    ({"type": "json_schema"}, "response_format.json_schema: expected an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema: missing"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema: expected"),
    ({"type": "json_schema", "json_schema": {"schema": "{bad"}}, "response_format.json_schema.schema: not valid JSON"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict"),
    ({"type": "regex_schema"}, "response_format.regex_schema: expected a string"),
    ({"type": "regex_schema", "regex_schema": " "}, "response_format.regex_schema: must not be empty"),
    ({"type": "ebnf", "ebnf": 5}, "response_format.ebnf: expected a string"),
])
def test_malformed_objects_name_the_field(rf, field):
    with pytest.raises(ConfigError) as e:
        parse_response_format(rf)
    assert str(e.value).startswith(field), str(e.value)


def test_spec_wire_round_trip():
    for spec in (GrammarSpec("json_object"), GrammarSpec("regex", "a|b"),
                 parse_response_format({"type": "json_schema", "json_schema": {"schema": SCHEMA}})):
        wire = json.loads(json.dumps(spec_to_dict(spec)))
        assert spec_from_dict(wire) == spec


@pytest.mark.parametrize("d,field", [
    ("x", "grammar: expected an object"), ({"kind": "yaml"}, "grammar.kind"),
    ({"kind": "regex", "source": 1}, "grammar.source"), ({"kind": "regex"}, "grammar.source"),
])
def test_spec_from_dict_errors(d, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        spec_from_dict(d)
