"""Every jsonschemabench schema compiles or is rejected with a message; nothing crashes."""

from __future__ import annotations

import time

import pytest

from specd.grammar.backend import GrammarSpec
from specd.grammar.compiler import GrammarCompileError, GrammarCompilerCache
from specd.grammar.response_format import parse_response_format
from specd.messages import ConfigError

SWEEP_SECONDS = 60.0


def test_all_600_schemas_compile_or_fail_cleanly(schema_files, tokenizer):
    cache = GrammarCompilerCache(tokenizer, 512, eos_token_ids=[1, 3], max_entries=len(schema_files))
    compiled, rejected, crashed = 0, [], []
    start = time.perf_counter()
    for path in schema_files:
        rf = {"type": "json_schema", "json_schema": {"name": path.stem, "schema": path.read_text(encoding="utf-8")}}
        try:
            cache.validate(parse_response_format(rf))
            compiled += 1
        except ConfigError as e:  # GrammarCompileError is one
            rejected.append((path.name, str(e)))
        except Exception as e:  # noqa: BLE001 - what this test is looking for
            crashed.append((path.name, repr(e)))
    seconds = time.perf_counter() - start
    print(f"\n{len(schema_files)} schemas in {seconds:.1f} s: compiled {compiled}, rejected {len(rejected)}, "
          f"crashed {len(crashed)}")
    for name, message in rejected:
        print(f"  rejected {name}: {message}")
    assert len(schema_files) == 600
    assert not crashed, crashed
    assert all(message.split(":", 1)[1].strip() for _, message in rejected)
    assert cache.num_compiles == compiled
    assert seconds < SWEEP_SECONDS


@pytest.mark.parametrize("source", [
    "", "null", "1", '"x"', "false", '{"$ref": "#"}', '{"type": ["string", {"a": 1}]}',
    '{"properties": 5}', '{"required": "a"}', '{"enum": []}', '{"type": "object", "properties": {"a": {"$ref": "#/x/y"}}}',
    '{"type": "string", "pattern": "[[:alpha:]]"}', '{"type": "array", "minItems": 3, "maxItems": 1}',
    '{"type": "string", "minLength": -1}', '{"anyOf": []}', '{"allOf": [{"type": "string"}, {"type": "integer"}]}',
    "{" * 500 + "}" * 500, '{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}',
])
def test_odd_schemas_never_crash(cache, source):
    try:
        cache.validate(GrammarSpec("json_schema", source))
    except GrammarCompileError as e:
        assert str(e).split(":", 1)[1].strip()


@pytest.mark.parametrize("kind,source", [
    ("regex", ""), ("regex", "\\"), ("regex", "[a-"), ("regex", "a{99999999}"), ("regex", "(?P<n>a)"),
    ("regex", "\\1"), ("ebnf", ""), ("ebnf", "root ::="), ("ebnf", 'root ::= root "a"'), ("ebnf", "root ::= [z-a]"),
])
def test_odd_regexes_and_grammars_never_crash(cache, kind, source):
    try:
        cache.validate(GrammarSpec(kind, source))
    except GrammarCompileError as e:
        assert str(e).split(":", 1)[1].strip()


def nested_schema(levels: int) -> str:
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


@pytest.mark.parametrize("levels", [200, 5000])  # past max_schema_depth; and past Python's parser
def test_deeply_nested_schemas_are_rejected_fast(cache, levels):
    """xgrammar's compile time explodes with nesting (and cannot be interrupted): bound it."""
    start = time.perf_counter()
    with pytest.raises(GrammarCompileError, match="nests deeper than 128 levels"):
        cache.validate(GrammarSpec("json_schema", nested_schema(levels)))
    assert time.perf_counter() - start < 1.0
    cache.validate(GrammarSpec("json_schema", nested_schema(40)))  # 81 levels: fine


def test_response_format_rejects_schema_text_nested_past_pythons_parser():
    with pytest.raises(ConfigError, match="schema: nested too deeply"):
        parse_response_format({"type": "json_schema", "json_schema": {"schema": nested_schema(5000)}})
