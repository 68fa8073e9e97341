"""vLLM's guided-decoding request fields, served as the `response_format` each one stands for.

Clients written for vLLM send `guided_json`, `guided_regex`, `guided_choice` or `guided_grammar`
instead of OpenAI's `response_format`; specd constrains their output the same way (the grammar
service, draft masking, the verifier's masks), rather than ignoring the field. One constraint per
request: two of them, or one beside `response_format`, is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.errors import GatewayError

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _ebnf_literal(text: str) -> str:
    """text as an EBNF string literal (the grammar's escapes: backslash, quote, control characters)."""
    return json.dumps(text, ensure_ascii=False)


def guided_response_format(name: str, value: Any) -> dict:
    """The response_format object for one guided field's value (the caller checked its type)."""
    if name == "guided_json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError:
                raise GatewayError(400, "guided_json: not valid JSON", param=name) from None
        if not isinstance(schema, dict):
            raise GatewayError(400, "guided_json: expected a JSON schema object", param=name)
        return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}}
    if name == "guided_regex":
        return {"type": "regex_schema", "regex_schema": value}
    if name == "guided_choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise GatewayError(400, "guided_choice: expected a list of non-empty strings", param=name)
        return {"type": "ebnf", "ebnf": "root ::= " + " | ".join(_ebnf_literal(c) for c in value)}
    return {"type": "ebnf", "ebnf": value}  # guided_grammar


def constraint_of(response_format: dict | None, guided: dict[str, Any]) -> dict | None:
    """The request's one output constraint: response_format, or the guided field given (None
    values are absent fields); None for plain text."""
    given = {name: value for name, value in guided.items() if value is not None}
    if len(given) > 1:
        raise GatewayError(400, f"{', '.join(given)}: give one guided field", param=next(iter(given)))
    if given:
        name, value = given.popitem()
        if response_format is not None and response_format.get("type") != "text":
            raise GatewayError(400, f"{name}: give it or response_format, not both", param=name)
        return guided_response_format(name, value)
    return None if response_format is None or response_format.get("type") == "text" else response_format
