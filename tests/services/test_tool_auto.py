"""tool_choice `auto` reads the calls a model writes, in each parser's format.

The tiny random target never writes a call, so each format gets a tiny target fine-tuned here (a
few seconds on the CPU) to answer weather questions with a call in that format and greetings with
text. Through the whole stack and the OpenAI client, `auto` then returns the model's call as
`tool_calls` (whole and streamed) and its greeting as content.
"""

from __future__ import annotations

import json

import openai
import pytest

from services.gateway.tool_formats import FORMATS
from tests.services.fine_tune import fine_tune_chat
from tests.services.test_e2e import start_stack
from tests.services.test_tools_e2e import reassemble

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CITIES = ["Paris", "Oslo", "Lima", "Cairo"]
GREETINGS = ["hello", "good morning"]
# ChatML with the tools listed in a system turn: enough for llama3_json and deepseek_v3, whose
# real templates are not in this repository (the parser is named with --tool-call-parser).
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def call_text(fmt, name: str, arguments: dict) -> str:
    return (fmt.section_begin + fmt.call_begin.replace("{name}", name) + json.dumps(arguments) + fmt.call_end
            + fmt.section_end)


def fine_tune(base, out_dir, fmt) -> None:
    """The base target, taught to call get_weather for weather questions and to greet back."""
    pairs = [(f"weather in {c}?", call_text(fmt, "get_weather", {"city": c})) for c in CITIES]
    pairs += [(g, "Hi there!") for g in GREETINGS]
    fine_tune_chat(base, out_dir, pairs, tools=TOOLS, template=None if fmt.name == "hermes" else TOOLS_TEMPLATE)


@pytest.mark.slow
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_auto_returns_the_calls_the_model_writes(tiny_models, redis_url, tmp_path, fmt_name):
    fmt = FORMATS[fmt_name]
    fine_tune(tiny_models["target-llama"], tmp_path, fmt)
    stack = start_stack(tmp_path, "ngram", None, redis_url, tool_call_parser=fmt_name)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.server_port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        for city in CITIES[:2]:
            kwargs = dict(model=name, messages=[{"role": "user", "content": f"weather in {city}?"}], tools=TOOLS,
                          temperature=0, max_tokens=200)  # DeepSeek-V3's call: 143 tokens here
            choice = client.chat.completions.create(**kwargs).choices[0]
            assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
            [call] = choice.message.tool_calls
            assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": city})
            content, calls, finish = reassemble(client.chat.completions.create(stream=True, **kwargs))
            assert (content, finish) == ("", "tool_calls")
            assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
        greeting = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hello"}],
                                                  tools=TOOLS, temperature=0, max_tokens=32).choices[0]
        assert (greeting.message.content, greeting.message.tool_calls) == ("Hi there!", None)
    finally:
        stack.stop()
