"""Calendar-exact date formats (specd/grammar/calendar.py) through the real xgrammar compiler."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from specd.grammar.calendar import exact_calendar_formats
from specd.grammar.compiler import GrammarCompilerCache
from specd.grammar.backend import GrammarSpec

DATES = {"2024-02-29": True, "2000-02-29": True, "2023-02-28": True, "2023-04-30": True,
         "2023-12-31": True, "0001-01-01": True, "2023-02-29": False, "1900-02-29": False,
         "2023-02-31": False, "2023-04-31": False, "0000-01-01": False, "2023-13-01": False}


@pytest.fixture(scope="module")
def compiler(strict_cache):
    return strict_cache._compiler  # xgrammar's compiler for the tiny target's tokenizer


@pytest.mark.parametrize("fmt,suffix", [("date", ""), ("date-time", "T23:59:60.25+05:30")])
def test_only_real_calendar_dates_are_accepted(compiler, fmt, suffix):
    compiled = compiler.compile_json_schema(exact_calendar_formats(json.dumps({"type": "string", "format": fmt})),
                                            any_whitespace=False, strict_mode=True)
    for day, real in DATES.items():
        matcher = xgr.GrammarMatcher(compiled)
        accepted = matcher.accept_string(json.dumps(day + suffix)) and matcher.is_completed()
        assert accepted == real, (fmt, day)


@pytest.mark.parametrize("time,ok", [("T12:00:00Z", True), ("T12:00:00.125-03:30", True), ("T23:59:60Z", True),
                                     ("T12:00:0012Z", False), ("T12:00:00.Z", False), ("T24:00:00Z", False),
                                     ("T02:04:0204-20:16", False)])
def test_date_time_keeps_the_rfc3339_time(compiler, time, ok):
    """The fraction is no optional group: xgrammar would drop its dot (00:00:0012Z, seen in the sweep)."""
    compiled = compiler.compile_json_schema(exact_calendar_formats(json.dumps({"type": "string", "format": "date-time"})),
                                            any_whitespace=False, strict_mode=True)
    matcher = xgr.GrammarMatcher(compiled)
    assert (matcher.accept_string(json.dumps("2024-02-29" + time)) and matcher.is_completed()) == ok


def test_values_and_explicit_patterns_are_left_alone():
    schema = {"type": "object", "properties": {
        "when": {"type": "string", "format": "date"},
        "format": {"type": "string", "format": "date-time"},  # a property named "format"
        "own": {"type": "string", "format": "date", "pattern": "^2024-.*$"}},
        "const": {"format": "date"}, "examples": [{"format": "date"}]}
    out = json.loads(exact_calendar_formats(json.dumps(schema)))
    assert "format" not in out["properties"]["when"] and out["properties"]["when"]["pattern"].startswith("^(")
    assert "pattern" in out["properties"]["format"] and "T" in out["properties"]["format"]["pattern"]
    assert out["properties"]["own"] == schema["properties"]["own"]
    assert out["const"] == {"format": "date"} and out["examples"] == [{"format": "date"}]
    text = json.dumps({"type": "string", "format": "email"})
    assert exact_calendar_formats(text) is text  # nothing to rewrite: the user's text itself


def test_the_compile_cache_applies_it(strict_cache: GrammarCompilerCache):
    grammar = strict_cache.sequence_grammar(GrammarSpec("json_schema", json.dumps(
        {"type": "string", "format": "date"})))
    assert grammar.matcher.accept_string('"2023-02-2')
    assert not grammar.matcher.fork().accept_string('9"')  # 2023-02-29: not a day
