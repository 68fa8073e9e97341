"""Calendar-exact `date` and `date-time` formats for xgrammar.

xgrammar's grammar for `"format": "date"` is `\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])`: it
admits 2023-02-31, 2023-04-31, 2023-02-29 and year 0000, which no validator accepts (the sweep's
models wrote such dates). Before compiling, every schema node whose format is date or date-time
(and which has no pattern of its own) gets the same format spelled as a pattern that knows the
calendar: 30- and 31-day months, February 29 only in leap years (divisible by 4, centuries only
when divisible by 400), years 0001-9999. The time part is xgrammar's own (RFC 3339, leap second,
Z or a numeric offset). Values (const, enum, default, examples) are data, not schemas: never
rewritten.
"""

from __future__ import annotations

import json

_YEAR = r"(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (r"((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
              r"|02-(0[1-9]|1[0-9]|2[0-8]))")
DATE = rf"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_OFFSET = r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
# The fraction is spelled as an alternation, not "(\.[0-9]+)?": xgrammar drops the literal of an
# optional group holding a repetition (it accepts 00:00:0012Z; schema_gaps.py refuses such patterns).
TIME = rf"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)({_OFFSET}|[.][0-9]+{_OFFSET})"
PATTERNS = {"date": f"^{DATE}$", "date-time": f"^{DATE}T{TIME}$"}
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rewrite(node):
    if isinstance(node, list):
        return [_rewrite(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: (value if key in _DATA_KEYWORDS else _rewrite(value)) for key, value in node.items()}
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in PATTERNS and "pattern" not in out:
        del out["format"]
        out["pattern"] = PATTERNS[fmt]
    return out


def exact_calendar_formats(schema_text: str) -> str:
    """The schema text with date / date-time formats as calendar-exact patterns (unchanged text
    when it has none, so the compile cache keys and messages stay the user's)."""
    if '"date' not in schema_text:
        return schema_text
    schema = json.loads(schema_text)
    rewritten = _rewrite(schema)
    return schema_text if rewritten == schema else json.dumps(rewritten)
