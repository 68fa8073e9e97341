"""`response_format` (OpenAI's, with lmdeploy's extras) -> GrammarSpec, and a spec's wire form.

Accepted objects:
    {"type": "text"}                                             -> None (unconstrained)
    {"type": "json_object"}                                      -> any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    {"type": "regex_schema", "regex_schema": "..."}              (lmdeploy)
    {"type": "ebnf", "ebnf": "..."} or {"type": "grammar", "grammar": "..."}  (EBNF, root rule `root`)
    {"type": "structural_tag", "format": {...}}                  (xgrammar's structural tag, as vLLM's)

Parsing checks the shape only; whether the schema / regex / grammar compiles is the compiler's
question (GrammarCompilerCache.validate), because that needs the tokenizer.
"""

from __future__ import annotations

import json
from typing import Any, get_args

from specd.grammar.backend import GrammarKind, GrammarSpec
from specd.messages import ConfigError

FIELD = "response_format"
GRAMMAR_KINDS: tuple[str, ...] = get_args(GrammarKind)
# type -> (GrammarSpec kind, the key holding the source text)
_TEXT_SOURCES = {"regex_schema": ("regex", "regex_schema"), "ebnf": ("ebnf", "ebnf"),
                 "grammar": ("ebnf", "grammar")}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag", *_TEXT_SOURCES)


def _fail(path: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {message}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def parse_response_format(rf: dict | None) -> GrammarSpec | None:
    """The grammar a request's response_format asks for; None when the output is unconstrained.

    Raises ConfigError("response_format...: ...") naming the bad field of a malformed object.
    """
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _fail(FIELD, f"expected an object, got {_type_name(rf)}")
    kind = rf.get("type")
    if kind is None:
        raise _fail(f"{FIELD}.type", f"missing; expected one of {', '.join(RESPONSE_FORMAT_TYPES)}")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise _fail(f"{FIELD}.type", f"expected one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        return GrammarSpec("json_schema", _schema_source(rf.get("json_schema"), f"{FIELD}.json_schema"))
    if kind == "structural_tag":
        return GrammarSpec("structural_tag", _structural_tag_source(rf.get("format"), f"{FIELD}.format"))
    spec_kind, key = _TEXT_SOURCES[kind]
    source = rf.get(key)
    if not isinstance(source, str):
        raise _fail(f"{FIELD}.{key}", f"expected a string, got {_type_name(source)}")
    if not source.strip():
        raise _fail(f"{FIELD}.{key}", "must not be empty")
    return GrammarSpec(spec_kind, source)


def _schema_source(json_schema: Any, path: str) -> str:
    """The schema as compact JSON text (key order kept: it is the order properties are generated)."""
    if not isinstance(json_schema, dict):
        raise _fail(path, f"expected an object with a 'schema', got {_type_name(json_schema)}")
    name = json_schema.get("name")
    if name is not None and not isinstance(name, str):
        raise _fail(f"{path}.name", f"expected a string, got {_type_name(name)}")
    strict = json_schema.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _fail(f"{path}.strict", f"expected true or false, got {strict!r}")
    if "schema" not in json_schema:
        raise _fail(f"{path}.schema", "missing")
    schema = json_schema["schema"]
    if isinstance(schema, str):  # some clients send the schema as JSON text
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _fail(f"{path}.schema", f"not valid JSON: {e}") from None
        except RecursionError:
            raise _fail(f"{path}.schema", "nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise _fail(f"{path}.schema", f"expected a JSON Schema object, got {_type_name(schema)}")
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _fail(f"{path}.schema", f"not JSON-serialisable: {e}") from None
    except RecursionError:
        raise _fail(f"{path}.schema", "nested too deeply") from None


def _structural_tag_source(fmt: Any, path: str) -> str:
    """The structural tag as JSON text; its formats are checked when it compiles (compiler.py)."""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _fail(path, f"expected a format object with a 'type', got {_type_name(fmt)}")
    try:
        return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False,
                          separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _fail(path, f"not JSON-serialisable: {e}") from None
    except RecursionError:
        raise _fail(path, "nested too deeply") from None


def spec_to_dict(spec: GrammarSpec) -> dict[str, str]:
    """The JSON-able wire form of a spec: {"kind": ..., "source": ...}."""
    return {"kind": spec.kind, "source": spec.source}


def spec_from_dict(d: dict) -> GrammarSpec:
    """Inverse of spec_to_dict; raises ConfigError("grammar...: ...") on a malformed object."""
    if not isinstance(d, dict):
        raise _fail("grammar", f"expected an object, got {_type_name(d)}")
    kind, source = d.get("kind"), d.get("source", "")
    if kind not in GRAMMAR_KINDS:
        raise _fail("grammar.kind", f"expected one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")
    if not isinstance(source, str):
        raise _fail("grammar.source", f"expected a string, got {_type_name(source)}")
    if kind != "json_object" and not source:
        raise _fail("grammar.source", f"must not be empty for kind {kind!r}")
    return GrammarSpec(kind, source)
