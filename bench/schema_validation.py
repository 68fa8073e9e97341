"""Judging one schema-sweep response: strict JSON, then `jsonschema` with format checking.

The validator class of the schema's `$schema` (Draft 2020-12 when it names none), with that
draft's FormatChecker. xgrammar enforces the formats date, time, date-time, email, uri, hostname,
uuid, ipv4, ipv6 (and duration) and ignores others (annotations in JSON Schema); the FormatChecker
checks those of them that jsonschema can check with the installed packages (date, email, uuid,
ipv4, ipv6; date-time and time are checked here by RFC 3339 checkers, because jsonschema's need
the optional rfc3339-validator package), and ignores unknown formats, as xgrammar does.
"""

from __future__ import annotations

import json
import re
from datetime import date

_RFC3339_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_TIME = re.compile(_RFC3339_TIME)
_DATE_TIME = re.compile(r"(\d{4}-\d{2}-\d{2})[Tt]" + _RFC3339_TIME)


def _is_time(value) -> bool:
    return not isinstance(value, str) or _TIME.fullmatch(value) is not None


def _is_date_time(value) -> bool:
    if not isinstance(value, str):
        return True
    m = _DATE_TIME.fullmatch(value)
    if m is None:
        return False
    try:
        date.fromisoformat(m.group(1))  # the calendar: no 2023-02-30, no year 0
    except ValueError:
        return False
    return True


def validator_for(schema):
    """The schema's draft's validator, with format checking (see the module docstring)."""
    import jsonschema
    from jsonschema import validators

    cls = validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    checker = cls.FORMAT_CHECKER
    if "date-time" not in checker.checkers:
        checker = jsonschema.FormatChecker()
        checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
        checker.checks("date-time")(_is_date_time)
        checker.checks("time")(_is_time)
    return cls(schema, format_checker=checker)


def judge(text: str, finish_reason: str | None, validator) -> tuple[str, str]:
    """(outcome, detail): outcome is valid, invalid or unfinished."""
    if finish_reason != "stop":
        return "unfinished", f"finish_reason {finish_reason!r} after {len(text)} characters"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return "invalid", f"not JSON: {e}"
    error = next(iter(validator.iter_errors(value)), None)
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        return "invalid", f"at /{where}: {error.message[:200]}"
    return "valid", ""
