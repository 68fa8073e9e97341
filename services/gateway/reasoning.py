"""Reasoning models' output: the thinking before `</think>` as `reasoning_content`, the answer after
it as `content` (`--reasoning-parser`, as vLLM's and lmdeploy's).

Two families: `deepseek_r1`, whose template opens `<think>` in the prompt, so the output starts
inside the reasoning; `qwen3`, whose output has reasoning only when it starts with `<think>` (the
template's `enable_thinking=False` leaves it out). A request's structured output or tool calls
then constrain only the answer: the grammar lets the reasoning run free until `</think>`
(`constrain_after`), so a schema never cuts the thinking short.

`split(text, final)` is the one parser, whole and streamed: with final=False a partial `<think>` or
`</think>` at the end is held back, so successive splits only grow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specd.grammar.response_format import parse_response_format
from specd.messages import ConfigError

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the prompt opened <think>: the output is reasoning until </think>

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of an output."""
        opened = text.startswith(THINK_START)
        if not opened and not final and THINK_START.startswith(text):
            return "", ""  # may still become <think>
        if not (opened or self.starts_inside):
            return "", text
        body = text[len(THINK_START):] if opened else text
        end = body.find(THINK_END)
        if end < 0:
            return (body if final else _without_partial(body, THINK_END)), ""
        return body[:end], body[end + len(THINK_END):].lstrip("\n")  # the blank line after it: no answer

    def constrain_after(self, response_format: dict) -> dict:
        """A structural tag: free reasoning up to </think>, then the response_format's constraint
        (a structural tag's format, or JSON schema / object, regex or EBNF as formats)."""
        answer = _as_format(response_format)
        begin = "" if self.starts_inside else THINK_START
        reasoned = {"type": "sequence", "elements": [
            {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": THINK_END},
            {"type": "regex", "pattern": "\n{0,2}"}, answer]}
        # qwen3 may answer without thinking (enable_thinking=False): the answer alone is one way.
        fmt = reasoned if self.starts_inside else {"type": "or", "elements": [reasoned, answer]}
        return {"type": "structural_tag", "format": fmt}


def _as_format(rf: dict) -> dict:
    """A response_format's constraint as a structural tag's format (ConfigError if malformed)."""
    spec = parse_response_format(rf)
    if spec is None:
        raise ConfigError("response_format: 'text' is no constraint to follow reasoning")
    if spec.kind == "structural_tag":
        return json.loads(spec.source)["format"]
    if spec.kind == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(spec.source)}
    if spec.kind == "json_object":  # any object: properties beyond none are allowed
        return {"type": "json_schema", "json_schema": {"type": "object", "additionalProperties": True}}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.source}
    return {"type": "grammar", "grammar": spec.source}


def _without_partial(text: str, marker: str) -> str:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text


FORMATS = {f.name: f for f in (ReasoningFormat("deepseek_r1", starts_inside=True),
                                ReasoningFormat("qwen3", starts_inside=False))}


def reasoning_format(name: str) -> ReasoningFormat | None:
    if not name:
        return None
    if name not in FORMATS:
        raise ConfigError(f"reasoning_parser: expected one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


@dataclass
class ReasoningStream:
    """A streamed choice's text as reasoning deltas, then content deltas."""

    fmt: ReasoningFormat
    text: str = ""
    _sent: tuple[int, int] = (0, 0)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.fmt.split(self.text, final)
        out = reasoning[self._sent[0]:], content[self._sent[1]:]
        self._sent = (len(reasoning), len(content))
        return out
