"""How a model writes tool calls: one format per template family, for both directions.

Each format knows the text of a call in its family (Hermes/Qwen `<tool_call>` JSON, Llama 3.x
JSON, DeepSeek-V3's tool-call tokens). From it come the structural tag that constrains a request's
output (xgrammar: free text until a call's trigger, then the call's header and the function's
arguments as its JSON schema demands, under every speculative method) and the parser that reads
calls back out of the generated text, whole or as it streams.

`split(text, final)` is the one parser: content and calls of a text. With final=False it returns
only what cannot change as more text arrives (a partial trigger, trailing whitespace and an
unfinished call's arguments past the current end are held back), so streamed deltas are the
differences between successive splits and reassemble to the whole response.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from specd.messages import ConfigError


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text; partial while not done
    done: bool


@dataclass
class Split:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's call text: [section_begin] (header(name) ARGUMENTS end)+ [section_end]."""

    name: str
    trigger: str  # the text every call (or the calls' section) starts with
    header: re.Pattern  # matches from the trigger (or a call's start in a section) to the arguments
    end: re.Pattern  # after the arguments' JSON value
    call_begin: str  # header text for a function, "{name}" filled in (names are [A-Za-z0-9_-])
    call_end: str
    section_begin: str = ""  # DeepSeek-V3: calls are wrapped in one section
    section_end: str = ""
    separator: str = "\n"  # between parallel calls (within a section)
    markers: tuple[str, ...] = ()  # text in a chat template that identifies the family

    # ---- constraining -------------------------------------------------------------------------
    def structural_tag(self, functions: list[tuple[str, dict]], *, required: bool, parallel: bool) -> dict:
        """response_format for calls of `functions` ((name, parameters schema)): free text and
        calls (required=False: `auto`), or calls alone, at least one (`required`, a named function)."""
        tags = [{"type": "tag", "begin": self.call_begin.replace("{name}", name),
                 "content": {"type": "json_schema", "json_schema": schema}, "end": self.call_end}
                for name, schema in functions]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                 "at_least_one": True, "stop_after_first": not parallel}
        if self.section_begin:
            section = {"type": "tag", "begin": self.section_begin, "content": calls, "end": self.section_end}
            fmt = section if required else {"type": "triggered_tags", "triggers": [self.trigger],
                                            "tags": [section], "stop_after_first": True}
        elif required:
            fmt = calls
        else:
            fmt = {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                   "stop_after_first": not parallel}
        return {"type": "structural_tag", "format": fmt}

    # ---- parsing ------------------------------------------------------------------------------
    def split(self, text: str, final: bool) -> Split:
        out = Split("")
        pos = 0
        while True:
            start = text.find(self.trigger, pos)
            segment = text[pos:] if start < 0 else text[pos:start]
            if start < 0 and not final:
                segment = _without_partial(segment, self.trigger).rstrip()
            elif start >= 0:
                segment = segment.rstrip()
            out.content += self._after_call(segment, final or start >= 0) if out.calls else segment
            if start < 0:
                return out
            num_before = len(out.calls)
            end = self._read_calls(text, start, out.calls)
            if end is None:  # unfinished: held back; final (cut short or malformed): content
                if final:
                    if not any(c.done for c in out.calls[num_before:]):
                        out.content += text[start:].lstrip() if out.calls else text[start:]
                    out.calls = [c for c in out.calls if c.done]
                return out
            pos = end

    def _after_call(self, segment: str, complete: bool) -> str:
        """Text after a call, less the separator between calls (Llama's "; ") and whitespace."""
        segment, separator = segment.lstrip(), self.separator.strip()
        if separator and segment.startswith(separator):
            return segment[len(separator):].lstrip()
        if separator and not complete and separator.startswith(segment):
            return ""
        return segment

    def _read_calls(self, text: str, start: int, calls: list[ParsedCall]) -> int | None:
        """Reads the call (or section of calls) at `start` into `calls`; the index past it, or None
        while it is unfinished (or malformed: then no call from there on is added)."""
        pos = start
        if self.section_begin:
            pos += len(self.section_begin)
        while True:
            header = self.header.match(text, pos)
            if header is None:
                return None
            args_start = header.end()
            args_end = json_value_end(text, args_start)
            if args_end is None:
                partial = text[args_start:]
                if partial[:1] in ("{", "["):  # streamable: every character so far is the value's
                    calls.append(ParsedCall(header["name"], partial, done=False))
                return None
            arguments = text[args_start:args_end]
            if arguments.startswith('"'):  # arguments written as a JSON string holding JSON
                arguments = json.loads(arguments)
            end = self.end.match(text, args_end)
            calls.append(ParsedCall(header["name"], arguments, done=end is not None))
            if end is None:
                return None
            pos = end.end()
            if not self.section_begin:
                return pos
            if text.startswith(self.section_end, pos):
                return pos + len(self.section_end)
            if text.startswith(self.separator, pos):
                pos += len(self.separator)
            elif self.header.match(text, pos) is None:
                return None


def _without_partial(text: str, trigger: str) -> str:
    """text less a suffix that may be the start of the trigger."""
    for n in range(min(len(trigger) - 1, len(text)), 0, -1):
        if text.endswith(trigger[:n]):
            return text[:-n]
    return text


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at text[start] (strings, objects, arrays, scalars),
    or None when the text ends inside it."""
    if start >= len(text):
        return None
    first = text[start]
    if first not in "{[\"":
        m = re.compile(r"-?[0-9.eE+\-]+|true|false|null").match(text, start)
        return m.end() if m and m.end() < len(text) else None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


_NAME = r'"(?P<name>[^"\\]*)"'

HERMES = ToolCallFormat(
    name="hermes", trigger="<tool_call>",
    header=re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"arguments"\s*:\s*'),
    end=re.compile(r"\s*\}\s*</tool_call>"),
    call_begin='<tool_call>\n{"name": "{name}", "arguments": ', call_end="}\n</tool_call>",
    markers=("<tool_call>",))

LLAMA3_JSON = ToolCallFormat(
    name="llama3_json", trigger='{"name"',
    header=re.compile(r'\{"name"\s*:\s*' + _NAME + r'\s*,\s*"parameters"\s*:\s*'),
    end=re.compile(r"\s*\}"),
    call_begin='{"name": "{name}", "parameters": ', call_end="}", separator="; ",
    markers=("<|python_tag|>", "Environment: ipython"))

DEEPSEEK_V3 = ToolCallFormat(
    name="deepseek_v3", trigger="<｜tool▁calls▁begin｜>",
    header=re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>(?P<name>[^\n]*)\n```json\n"),
    end=re.compile(r"\n```<｜tool▁call▁end｜>"),
    call_begin="<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
    call_end="\n```<｜tool▁call▁end｜>",
    section_begin="<｜tool▁calls▁begin｜>", section_end="<｜tool▁calls▁end｜>", separator="\n",
    markers=("<｜tool▁calls▁begin｜>",))

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, DEEPSEEK_V3)}


def tool_call_format(name: str, chat_template: str | None) -> ToolCallFormat | None:
    """The format named (`--tool-call-parser`), else the one whose markers the template holds."""
    if name:
        if name not in FORMATS:
            raise ConfigError(f"tool_call_parser: expected one of {', '.join(FORMATS)}, got {name!r}")
        return FORMATS[name]
    template = chat_template if isinstance(chat_template, str) else ""
    for fmt in FORMATS.values():
        if any(marker in template for marker in fmt.markers):
            return fmt
    return None
