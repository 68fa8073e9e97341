"""JSON-schema features xgrammar 0.2.9 compiles without a word but enforces wrongly.

xgrammar warns when it approximates some keywords (compiler.py refuses those schemas); the
features here it gets wrong silently, so a response that follows its grammar may still break the
schema. find_schema_gaps names them so that the compiler refuses such a schema up front (HTTP 400);
tests/grammar/test_schema_gaps.py shows xgrammar's wrong output for each:

- ignored keywords: dependencies / dependentRequired / dependentSchemas, if / then / else, not,
  contains, uniqueItems;
- anyOf / oneOf / allOf, or $ref where its siblings apply (2019-09 and later, or no draft named),
  next to other assertions: the siblings are dropped;
- enum / const next to type: the enum values are emitted whatever their type;
- pattern, minLength, minimum, minItems, ... without a type: any JSON value is allowed;
- format next to pattern: the pattern is dropped;
- a required property that `properties` does not declare: the requirement is dropped;
- a regex with an optional group (`(...)?`, `{0,n}`) holding a variable repetition: the string may
  end inside the group (`^y(z*a)?$` accepts "yz").
"""

from __future__ import annotations

import warnings

try:  # the regex parser behind `re` (Python 3.11+: re._parser; before: sre_parse)
    from re import _constants as _sre_constants, _parser as _sre_parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_constants  # type: ignore[no-redef]
    import sre_parse as _sre_parser  # type: ignore[no-redef]

IGNORED_KEYWORDS = ("dependencies", "dependentRequired", "dependentSchemas", "if", "then", "else", "not",
                    "contains", "minContains", "maxContains")
COMBINATORS = ("anyOf", "oneOf", "allOf")
# The keywords that constrain an instance (unknown keywords are annotations, as for validators);
# format counts: xgrammar enforces the formats it knows.
_ASSERTIONS = frozenset({"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
                         "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems",
                         "minItems", "uniqueItems", "maxContains", "minContains", "maxProperties",
                         "minProperties", "required", "dependentRequired", "properties", "patternProperties",
                         "additionalProperties", "unevaluatedProperties", "items", "prefixItems",
                         "additionalItems", "unevaluatedItems", "contains", "propertyNames", "allOf", "anyOf",
                         "oneOf", "not", "if", "then", "else", "dependentSchemas", "dependencies", "$ref"})
# Drafts whose $ref replaces the whole schema object (siblings ignored by the spec itself).
_REF_OVERRIDES_DRAFTS = ("draft-03", "draft-04", "draft-05", "draft-06", "draft-07")
# Keywords xgrammar applies only under a declared type (without one it compiles any JSON value).
_TYPED_KEYWORDS = ("pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
                   "exclusiveMaximum", "multipleOf", "minItems", "maxItems")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "null": (type(None),), "array": (list,), "object": (dict,)}
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems",
                  "unevaluatedItems", "contains", "propertyNames", "not", "if", "then", "else")


def find_schema_gaps(schema) -> list[str]:
    """The features of schema (a parsed JSON Schema) that xgrammar would enforce wrongly, each once."""
    draft = schema.get("$schema", "") if isinstance(schema, dict) else ""
    ref_siblings_apply = not any(d in str(draft) for d in _REF_OVERRIDES_DRAFTS)
    gaps: list[str] = []
    stack = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for gap in _node_gaps(node, ref_siblings_apply):
            gaps.append(f"{gap} (at {path or '/'})")
        stack.extend(reversed(list(_subschemas(node, path))))
    return list(dict.fromkeys(gaps))


def _subschemas(node: dict, path: str):
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield sub, f"{path}/{key}/{name}"
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield sub, f"{path}/{key}/{i}"
    for key in _SCHEMA_VALUES:
        sub = node.get(key)
        if isinstance(sub, dict):
            yield sub, f"{path}/{key}"
        elif key == "items" and isinstance(sub, list):
            for i, item in enumerate(sub):
                yield item, f"{path}/items/{i}"
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, sub in deps.items():
            if isinstance(sub, dict):
                yield sub, f"{path}/dependencies/{name}"


def _node_gaps(node: dict, ref_siblings_apply: bool):
    for key in IGNORED_KEYWORDS:
        if key in node:
            yield f"the keyword {key!r} (ignored by the grammar engine)"
    if node.get("uniqueItems") is True:
        yield "the keyword 'uniqueItems' (ignored by the grammar engine)"
    assertions = [k for k in node if k in _ASSERTIONS]
    combinators = [k for k in COMBINATORS if k in node]
    if combinators and len(assertions) > 1:
        others = [k for k in assertions if k != combinators[0]]
        yield f"{combinators[0]} next to {', '.join(others)} (the grammar engine drops the siblings)"
    elif "$ref" in node and ref_siblings_apply and len(assertions) > 1:
        others = [k for k in assertions if k != "$ref"]
        yield f"$ref next to {', '.join(others)} (the grammar engine drops the siblings)"
    for key in ("enum", "const"):
        if key in node and "type" in node and not _values_have_type(node[key] if key == "enum" else [node[key]],
                                                                     node["type"]):
            yield f"{key} values outside the declared type {node['type']!r} (the grammar engine emits them)"
    untyped = [k for k in _TYPED_KEYWORDS if k in node]
    if untyped and "type" not in node and "enum" not in node and "const" not in node:
        yield f"{untyped[0]} without a type (the grammar engine then allows any value)"
    if "format" in node and "pattern" in node:
        yield "format next to pattern (the grammar engine drops the pattern)"
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list) and required:
        declared = properties if isinstance(properties, dict) else {}
        missing = [r for r in required if isinstance(r, str) and r not in declared]
        if missing:
            yield f"required property {missing[0]!r} not declared in properties (the grammar engine drops it)"
    patterns = []
    if isinstance(node.get("pattern"), str):
        patterns.append(node["pattern"])
    if isinstance(node.get("patternProperties"), dict):
        patterns.extend(k for k in node["patternProperties"] if isinstance(k, str))
    for pattern in patterns:
        if regex_has_optional_repetition(pattern):
            yield (f"the regex {pattern[:60]!r}: an optional group holding a repetition "
                   f"(the grammar engine lets the string end inside it)")


def _values_have_type(values, declared) -> bool:
    if not isinstance(values, list):
        return True  # malformed: xgrammar's own checks answer
    names = declared if isinstance(declared, list) else [declared]
    types = tuple(t for n in names for t in _JSON_TYPES.get(n, ()))
    if not types:
        return True

    def fits(v) -> bool:
        if isinstance(v, bool):
            return bool in types
        return isinstance(v, types) and not (isinstance(v, float) and "integer" in names and not v.is_integer()
                                             and "number" not in names)

    return all(fits(v) for v in values)


_REPEATS = (_sre_constants.MAX_REPEAT, _sre_constants.MIN_REPEAT) + (
    (_sre_constants.POSSESSIVE_REPEAT,) if hasattr(_sre_constants, "POSSESSIVE_REPEAT") else ())


def regex_has_optional_repetition(pattern: str) -> bool:
    """Whether pattern has a group repeated {0,n} (n finite) whose body repeats something m..n times.

    Patterns Python's parser does not read (ECMA-only syntax) are left to xgrammar's own checks.
    """
    try:
        with warnings.catch_warnings():  # Python's own warnings about its syntax ("nested set")
            warnings.simplefilter("ignore")
            parsed = _sre_parser.parse(pattern)
    except Exception:  # noqa: BLE001 - re.error, or odd input the parser trips on
        return False
    return _scan(parsed, inside_optional=False)


def _scan(items, inside_optional: bool) -> bool:
    for op, av in items:
        if op in _REPEATS:
            lo, hi, body = av
            if inside_optional and lo != hi:
                return True
            optional = lo == 0 and hi != _sre_constants.MAXREPEAT
            if _scan(body, inside_optional or optional):
                return True
        elif op == _sre_constants.SUBPATTERN:
            if _scan(av[-1], inside_optional):
                return True
        elif op == _sre_constants.BRANCH:
            if any(_scan(branch, inside_optional) for branch in av[1]):
                return True
        elif op in (_sre_constants.ASSERT, _sre_constants.ASSERT_NOT):
            if _scan(av[1], inside_optional):
                return True
    return False
