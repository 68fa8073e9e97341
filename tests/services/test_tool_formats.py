"""Tool calls as text: each format's parser (whole and streamed), its structural tag against the
real grammar compiler, the request checks, and the trained family's template."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from services.gateway.errors import GatewayError
from services.gateway.tool_formats import DEEPSEEK_V3, FORMATS, HERMES, LLAMA3_JSON, tool_call_format
from services.gateway.tools import ToolCallStream, call_id, parse_tools, template_messages
from specd.grammar.backend import GrammarSpec
from specd.grammar.compiler import GrammarCompilerCache
from specd.grammar.response_format import parse_response_format
from specd.messages import ConfigError
from specd.models.loader import load_tokenizer
from specd.tiny_models.tokenizer import CHAT_TEMPLATE

REPO = Path(__file__).resolve().parents[2]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1}},
           "required": ["city", "days"]}
SEARCH = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
FUNCTIONS = [("get_weather", WEATHER), ("search", SEARCH)]
CALLS = [("get_weather", '{"city": "Paris", "days": 3}'), ("search", '{"q": "a } tricky \\" string ]"}')]


def call_text(fmt, calls) -> str:
    body = fmt.separator.join(fmt.call_begin.replace("{name}", n) + args + fmt.call_end for n, args in calls)
    return fmt.section_begin + body + fmt.section_end


def streamed(fmt, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]], set[str]]:
    """Feeds text in random pieces; the reassembled content, calls and the ids seen."""
    stream, content, calls, ids, i = ToolCallStream(fmt, "req-1"), "", {}, set(), 0
    while i < len(text):
        n = rng.randint(1, 7)
        piece_content, deltas = stream.feed(text[i:i + n], final=i + n >= len(text))
        i += n
        content += piece_content
        for d in deltas:
            entry = calls.setdefault(d["index"], ["", ""])
            if "id" in d:
                assert d["type"] == "function" and not entry[0]
                entry[0] = d["function"]["name"]
                ids.add(d["id"])
            entry[1] += d["function"]["arguments"]
    return content, [tuple(calls[k]) for k in sorted(calls)], ids


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_calls_parse_whole_and_streamed(fmt):
    text = "Let me look.\n" + call_text(fmt, CALLS) + "\n"
    split = fmt.split(text, final=True)
    assert split.content == "Let me look."
    assert [(c.name, c.arguments) for c in split.calls] == CALLS
    assert all(json.loads(c.arguments) for c in split.calls)
    for seed in range(30):
        content, calls, ids = streamed(fmt, text, random.Random(seed))
        assert (content, calls) == ("Let me look.", CALLS)
        assert ids == {call_id("req-1", 0), call_id("req-1", 1)}  # as the whole response names them


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_text_without_calls_is_all_content(fmt):
    text = "def f(x):\n    return {'name': x} < 3  \n"
    assert fmt.split(text, final=True).content == text
    content, calls, _ = streamed(fmt, text, random.Random(0))
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_a_call_cut_short_is_returned_as_text(fmt):
    """max_tokens inside a call: no half call is returned as one; its text stays readable."""
    whole = call_text(fmt, CALLS[:1])
    cut = whole[:len(whole) - len(fmt.call_end) - 4]
    split = fmt.split(cut, final=True)
    assert split.calls == [] and split.content == cut


def test_partial_trigger_is_held_back_until_it_resolves():
    stream = ToolCallStream(HERMES, "req-1")
    assert stream.feed("a <tool")[0] == "a"
    assert stream.feed("box>")[0] == " <toolbox>"


# ---- structural tags against the grammar compiler -------------------------------------------------
@pytest.fixture(scope="module")
def compiler():
    tokenizer = load_tokenizer(REPO / "models" / "specd-py-target")
    return tokenizer, GrammarCompilerCache(tokenizer, 8192, eos_token_ids=[tokenizer.eos_token_id])


def accepts(compiler, spec_dict: dict, text: str) -> bool:
    tokenizer, cache = compiler
    matcher = cache.sequence_grammar(parse_response_format(spec_dict)).matcher
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_structural_tags_enforce_the_schemas(compiler, fmt):
    required = fmt.structural_tag(FUNCTIONS, required=True, parallel=True)
    auto = fmt.structural_tag(FUNCTIONS, required=False, parallel=True)
    single = fmt.structural_tag(FUNCTIONS, required=True, parallel=False)
    good = call_text(fmt, CALLS)
    assert accepts(compiler, required, good) and accepts(compiler, auto, "Hi. " + good)
    assert not accepts(compiler, required, "Hi. " + good)  # required: calls first
    assert accepts(compiler, auto, "just text")
    assert not accepts(compiler, single, good)  # parallel_tool_calls false: one call
    assert accepts(compiler, single, call_text(fmt, CALLS[:1]))
    for bad in ('{"city": "Paris", "days": "3"}', '{"city": "Paris"}', '{"city": "Paris", "days": 0}',
                '{"city": "Paris\\u0000 and a very long tail", "days": 3}', '{"city": "P\x02", "days": 3}'):
        assert not accepts(compiler, required, call_text(fmt, [("get_weather", bad)])), bad


def test_a_schema_the_engine_cannot_enforce_is_refused(compiler):
    _, cache = compiler
    inexact = HERMES.structural_tag([("f", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}})],
                                    required=True, parallel=True)
    with pytest.raises(Exception, match="cannot enforce exactly|invalid"):
        cache.validate(parse_response_format(inexact))
    assert cache.validate(GrammarSpec("structural_tag", json.dumps(HERMES.structural_tag(
        FUNCTIONS, required=False, parallel=True)))) is None


# ---- request checks ------------------------------------------------------------------------------
def tool(name="f", **fn):
    return {"type": "function", "function": {"name": name, **fn}}


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "retrieval"}], tool_choice=None), "tools[0].type"),
    (dict(tools=[tool("bad name")], tool_choice=None), "tools[0].function.name"),
    (dict(tools=[tool(), tool()], tool_choice=None), "tools[1].function.name"),
    (dict(tools=[tool(parameters=[1])], tool_choice=None), "tools[0].function.parameters"),
    (dict(tools=[tool()], tool_choice="always"), "tool_choice"),
    (dict(tools=[tool()], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (dict(tools=None, tool_choice="required"), "tool_choice"),
    (dict(tools=[], tool_choice=None), "tools"),
])
def test_bad_tools_name_their_field(kwargs, param):
    with pytest.raises(GatewayError) as e:
        parse_tools(parallel_tool_calls=None, **kwargs)
    assert e.value.status == 400 and e.value.param == param


def test_choices_and_legacy_functions():
    assert parse_tools([tool()], None, None).choice == "auto"
    named = parse_tools([tool("f"), tool("g")], {"type": "function", "function": {"name": "g"}}, False)
    assert (named.choice, named.parallel) == ("g", False)
    legacy = parse_tools(None, None, None, functions=[{"name": "f"}], function_call={"name": "f"})
    assert legacy.choice == "f" and legacy.functions == {"f": {"type": "object", "properties": {}}}
    assert parse_tools([tool()], "none", None).response_format(HERMES) is None
    with pytest.raises(GatewayError):
        parse_tools(None, None, None, function_call="auto")


def test_assistant_call_arguments_reach_the_template_as_objects():
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    assert template_messages(messages)[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    with pytest.raises(GatewayError) as e:
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])
    assert e.value.param == "messages[0].tool_calls[0].function.arguments"


# ---- templates -------------------------------------------------------------------------------------
PLAIN_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")


def test_the_family_template_is_plain_chatml_without_tools():
    """The trained family saw plain ChatML; tools add Hermes sections only when a request has some."""
    tokenizer = load_tokenizer(REPO / "models" / "specd-py-target")
    conversations = [[{"role": "user", "content": "def f():"}],
                     [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                      {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]]
    for messages in conversations:
        for gen in (True, False):
            assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                              chat_template=PLAIN_CHATML)
    for model in ("specd-py-target", "specd-py-draft", "specd-py-eagle3", "specd-py-mtp"):
        assert (REPO / "models" / model / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    with_tools = tokenizer.apply_chat_template(conversations[1], tools=[tool("f")], tokenize=False)
    assert "<tools>" in with_tools and with_tools.count("<|im_start|>system") == 1


def test_the_format_comes_from_the_flag_or_the_template():
    assert tool_call_format("", CHAT_TEMPLATE) is HERMES
    assert tool_call_format("", PLAIN_CHATML) is None
    assert tool_call_format("llama3_json", PLAIN_CHATML) is LLAMA3_JSON
    assert tool_call_format("", "...<｜tool▁calls▁begin｜>...") is DEEPSEEK_V3
    with pytest.raises(ConfigError, match="tool_call_parser"):
        tool_call_format("mistral", CHAT_TEMPLATE)
