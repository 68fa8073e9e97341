"""Tool calling on chat requests: `tools`, `tool_choice`, `parallel_tool_calls` (and the legacy
`functions` / `function_call`), checked and turned into the template's input, the output's
constraint and the response's `tool_calls`.

Every call the server returns is written under a structural tag (tool_formats.py): with `auto` the
model writes text or calls, and a call's arguments follow its function's JSON schema; with
`required` or a named function it must call first. So arguments always validate, under
speculation as without it (drafts are masked by the same grammar, and the verifier's masked
target distribution keeps the output lossless).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import GatewayError
from services.gateway.tool_formats import ParsedCall, Split, ToolCallFormat

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolRequest:
    """A request's tools. choice: "none", "auto", "required", or the function name it must call."""

    functions: dict[str, dict]  # name -> parameters schema, in the order given
    template_tools: list[dict]  # what the chat template is given
    choice: str
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def response_format(self, fmt: ToolCallFormat) -> dict | None:
        """The structural tag the output is generated under (None for `none`)."""
        if self.choice == "none":
            return None
        named = self.choice not in ("auto", "required")
        functions = [(self.choice, self.functions[self.choice])] if named else list(self.functions.items())
        return fmt.structural_tag(functions, required=self.choice != "auto",
                                  parallel=self.parallel and not named)


def _fail(param: str, message: str) -> GatewayError:
    return GatewayError(400, f"{param}: {message}", param=param)


def parse_tools(tools: list | None, tool_choice: Any, parallel_tool_calls: bool | None,
                functions: list | None = None, function_call: Any = None) -> ToolRequest | None:
    """The request's tools, checked (400 naming the field); None when it has none."""
    if functions is not None:  # legacy function calling: the same, spelled differently
        if tools is not None:
            raise _fail("functions", "give tools or functions, not both")
        tools = [{"type": "function", "function": f} for f in functions]
        if isinstance(function_call, dict):
            tool_choice = {"type": "function", "function": function_call}
        elif function_call is not None:
            tool_choice = function_call
    elif function_call is not None:
        raise _fail("function_call", "needs functions")
    if not tools:
        if tool_choice not in (None, "none"):
            raise _fail("tool_choice", "needs tools")
        if tools is not None:
            raise _fail("tools", "must not be empty (leave it out for no tools)")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _fail("tools", f"expected a list of at most {MAX_TOOLS} tools")
    parsed: dict[str, dict] = {}
    template_tools = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _fail(f"{where}.type", "only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _fail(f"{where}.function", "expected an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise _fail(f"{where}.function.name", "expected 1-64 letters, digits, '_' or '-'")
        if name in parsed:
            raise _fail(f"{where}.function.name", f"{name!r} is given twice")
        parameters = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise _fail(f"{where}.function.parameters", "expected a JSON schema object")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise _fail(f"{where}.function.description", "expected a string")
        parsed[name] = parameters
        template_tools.append({"type": "function", "function": {**fn, "parameters": parameters}})
    choice = _choice(tool_choice if tool_choice is not None else "auto", parsed)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _fail("parallel_tool_calls", "expected true or false")
    return ToolRequest(parsed, template_tools, choice, parallel_tool_calls is not False)


def _choice(tool_choice: Any, functions: dict[str, dict]) -> str:
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _fail("tool_choice", f"expected none, auto, required or a function, got {tool_choice!r}")
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise _fail("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
    if name not in functions:
        raise _fail("tool_choice", f"names {name!r}, which is not among the tools")
    return name


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant turn's call arguments as objects (the
    API sends them as JSON text; templates write them with `tojson`)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            out.append(message)
            continue
        if not isinstance(calls, list):
            raise _fail(f"messages[{i}].tool_calls", "expected a list")
        converted = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _fail(f"messages[{i}].tool_calls[{j}].function", "expected an object with a name")
            arguments = fn.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments or "{}")
                except json.JSONDecodeError:
                    raise _fail(f"messages[{i}].tool_calls[{j}].function.arguments", "not valid JSON") from None
            converted.append({**call, "function": {**fn, "arguments": arguments}})
        out.append({**message, "tool_calls": converted})
    return out


def call_id(request_id: str, index: int) -> str:
    """A call's id: from its request's id and its place, so a retried request (Idempotency-Key)
    names its calls as the first answer did."""
    return "call_" + hashlib.blake2b(f"{request_id}:{index}".encode(), digest_size=12).hexdigest()


def tool_call_dict(call: ParsedCall, call_id: str, index: int | None = None) -> dict:
    out = {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


@dataclass
class ToolCallStream:
    """A streamed choice's text as content deltas and OpenAI tool-call deltas: each call's id,
    type and name once, then its arguments as they are written."""

    fmt: ToolCallFormat
    request_id: str
    text: str = ""
    _content_sent: int = 0
    _args_sent: list[int] = field(default_factory=list)  # per call
    _ids: list[str] = field(default_factory=list)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        split: Split = self.fmt.split(self.text, final)
        content = split.content[self._content_sent:]
        self._content_sent = len(split.content)
        deltas = []
        for i, call in enumerate(split.calls):
            if i == len(self._ids):
                self._ids.append(call_id(self.request_id, i))
                self._args_sent.append(0)
                deltas.append({"index": i, "id": self._ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            more = call.arguments[self._args_sent[i]:]
            if more:
                deltas.append({"index": i, "function": {"arguments": more}})
                self._args_sent[i] = len(call.arguments)
        return content, deltas

    @property
    def num_calls(self) -> int:
        return len(self._ids)
