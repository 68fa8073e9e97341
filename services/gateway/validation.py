"""Checks on decoded request values that neither pydantic nor protobuf make.

JSON may carry lone UTF-16 surrogates (`"\\ud800"`): valid JSON, but not text. Python keeps them in
str, and the tokenizer (Rust), Redis and the grammar compiler would fail on them far from the
request; they are refused here with the field named. Deep nesting is refused too, so a hostile
response_format cannot drive the grammar compiler's recursion.
"""

from __future__ import annotations

MAX_NESTING = 64  # JSON schemas in practice nest a dozen levels; xgrammar recurses per level
MAX_STOP_WORDS = 64  # each stop word is searched in every delta: bound their number (OpenAI allows 4)


def find_invalid_value(value, where: str = "") -> tuple[str, str] | None:
    """(path, problem) of the first string that is not valid Unicode text or of too deep nesting."""
    stack = [(value, where, 0)]  # iterative: the depth limit is ours, not Python's recursion limit
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                return path, f"not valid UTF-8 text (lone surrogate at character {e.start})"
        elif isinstance(item, list) and all(type(x) is int for x in item):
            continue  # token ids: the common large list, nothing to check inside
        elif isinstance(item, (dict, list, tuple)):
            if depth >= MAX_NESTING:
                return path, f"nested more than {MAX_NESTING} levels deep"
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str):
                    stack.append((key, path, depth + 1))
                stack.append((child, f"{path}.{key}" if path else str(key), depth + 1))
    return None
