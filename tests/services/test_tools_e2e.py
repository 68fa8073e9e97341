"""Tool calls through the whole stack (gateway, Redis, verifier, drafter, grammar service) with the
real OpenAI client: `required` and named calls always validate against the function's schema,
under every speculative method, greedy and sampled, whole and streamed; `tool` turns reach the
template; bad tools are refused with 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from specd.grammar.compiler import GrammarCompilerCache
from tests.conftest import JSONSCHEMABENCH
from tests.services.test_e2e import METHODS, start_stack

MAX_TOKENS = 512
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "unit", "days"]}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 3}},
          "required": ["query"]}
MESSAGES = [{"role": "user", "content": "import json\nfor value in data:"}]


def function(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}


def bench_schemas(model, count: int) -> list[dict]:
    """Real object schemas from jsonschemabench that the grammar engine enforces exactly, small
    enough to be a tool's parameters."""
    cache = GrammarCompilerCache.from_model_dir(model)
    out = []
    for path in sorted(JSONSCHEMABENCH.glob("*/*.json")):
        text = path.read_text(encoding="utf-8")
        schema = json.loads(text)
        if len(text) > 1500 or not isinstance(schema, dict) or schema.get("type") != "object":
            continue
        try:
            from specd.grammar.backend import GrammarSpec

            cache.validate(GrammarSpec("json_schema", json.dumps(schema)))
        except Exception:  # noqa: BLE001 - refused schemas are the structured-output tests' subject
            continue
        out.append(schema)
        if len(out) == count:
            break
    return out


def reassemble(chunks) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    assert entry["id"] is None, "a call's id is sent once"
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


def check_calls(calls: list[tuple[str, str]], schemas: dict[str, dict], named: str | None) -> None:
    assert calls, "required and named choices always call"
    for name, arguments in calls:
        assert name in schemas and (named is None or name == named)
        jsonschema.validate(json.loads(arguments), schemas[name])


def call_once(client, name, tools, schemas, choice, temperature, seed, stream):
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    kwargs = dict(model=name, messages=MESSAGES, tools=tools, tool_choice=choice, temperature=temperature,
                  seed=seed, max_tokens=MAX_TOKENS)
    if stream:
        content, calls, finish = reassemble(client.chat.completions.create(stream=True, **kwargs))
        assert all(c["id"].startswith("call_") for c in calls)
        pairs = [(c["name"], c["arguments"]) for c in calls]
    else:
        message = client.chat.completions.create(**kwargs).choices[0]
        finish, content = message.finish_reason, message.message.content
        pairs = [(c.function.name, c.function.arguments) for c in message.message.tool_calls or []]
    assert finish == "tool_calls" and not content
    check_calls(pairs, schemas, named)
    return pairs


@pytest.fixture(scope="module")
def stacks(tiny_models, redis_url):
    started = {}

    def get(method):
        if method not in started:
            target, draft = METHODS[method]
            started[method] = start_stack(tiny_models[target], method, tiny_models[draft] if draft else None,
                                          redis_url)
        stack = started[method]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.server_port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        return client, client.models.list().data[0].id
    try:
        yield get
    finally:
        for stack in started.values():
            stack.stop()


def test_required_and_named_calls_validate_and_stream(stacks):
    client, name = stacks("eagle3")
    tools = [function("get_weather", WEATHER), function("search", SEARCH)]
    schemas = {"get_weather": WEATHER, "search": SEARCH}
    for i, choice in enumerate(["required", {"type": "function", "function": {"name": "search"}}]):
        for temperature in (0.0, 1.0):
            whole = call_once(client, name, tools, schemas, choice, temperature, seed=7 + i, stream=False)
            parts = call_once(client, name, tools, schemas, choice, temperature, seed=7 + i, stream=True)
            if temperature == 0:  # (sampled: adaptive draft lengths follow timings, so the text may differ)
                assert parts == whole, "streamed deltas reassemble to the whole response"
    # parallel_tool_calls false: exactly one call
    single = client.chat.completions.create(model=name, messages=MESSAGES, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, temperature=1.0, seed=3,
                                            max_tokens=MAX_TOKENS)
    assert len(single.choices[0].message.tool_calls) == 1


def test_auto_without_a_call_is_plain_text_and_tool_turns_render(stacks):
    client, name = stacks("eagle3")
    tools = [function("get_weather", WEATHER)]
    plain = client.chat.completions.create(model=name, messages=MESSAGES, temperature=0, max_tokens=24)
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    for messages in (MESSAGES, conversation):
        auto = client.chat.completions.create(model=name, messages=messages, tools=tools, temperature=0,
                                              max_tokens=24)
        assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
        choice = auto.choices[0]
        if not choice.message.tool_calls:  # this random model writes text: content, as without tools
            assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    none = client.chat.completions.create(model=name, messages=MESSAGES, tools=tools, tool_choice="none",
                                          temperature=0, max_tokens=24)
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"not": {"type": "string"}}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_refused_naming_the_field(stacks, body, param):
    client, name = stacks("eagle3")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=8, **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_calls_validate_on_real_schemas_under_every_method(stacks, tiny_models, method):
    """40 calls a method (200 in all): real jsonschemabench schemas as tools, required and named,
    greedy and sampled; every call's arguments validate against its function's schema."""
    client, name = stacks(method)
    schemas = bench_schemas(tiny_models[METHODS[method][0]], 20)
    assert len(schemas) == 20
    for i in range(40):
        picked = [schemas[(i + j) % len(schemas)] for j in range(2)]
        by_name = {f"fn_{i}_{j}": s for j, s in enumerate(picked)}
        tools = [function(n, s) for n, s in by_name.items()]
        choice = "required" if i % 2 else {"type": "function", "function": {"name": f"fn_{i}_1"}}
        call_once(client, name, tools, by_name, choice, temperature=0.0 if i % 4 < 2 else 1.0, seed=i,
                  stream=i % 3 == 0)
