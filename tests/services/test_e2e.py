"""End to end: Redis, drafter, verifier and gateway as separate OS processes on real sockets.

For every speculative method, 32 concurrent requests (OpenAI client chat and completions, streaming
and not; gRPC unary and streaming) come back with exactly the in-process target-only greedy output.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from services.launcher.supervisor import Stack, StackConfig
from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig
from specd.models.loader import load_tokenizer
from specd.sampling_params import SamplingParams
from specd.transport.embedded_redis import start_embedded_redis
from specd.transport.ports import free_port
from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc

METHODS = {
    "eagle3": ("target-llama", "draft-eagle3"),
    "deepseek_mtp": ("target-deepseek-mtp", None),
    "qwen3_5_mtp": ("target-qwen3_5-mtp", None),
    "draft_model": ("target-llama", "draft-llama-small"),
    "ngram": ("target-llama", None),
}
NUM_REQUESTS = 32
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def shared_redis():
    server = start_embedded_redis()
    yield server.url
    server.stop()


def start_stack(model, method, draft, redis_url, k=3, **overrides) -> Stack:
    config = StackConfig(model=str(model), server_name="127.0.0.1", server_port=free_port(),
                         grpc_port=free_port(), redis_url=redis_url, speculative_algorithm=method,
                         speculative_draft_model=str(draft) if draft else None,
                         speculative_num_draft_tokens=k, max_batch_size=16, enable_metrics=True,
                         **overrides)
    stack = Stack(config)
    try:
        stack.start(timeout=240)
    except BaseException:
        stack.stop()
        raise
    return stack


def make_workload(tokenizer, seed=0):
    """NUM_REQUESTS requests, a quarter per client kind, each with its token-level prompt."""
    rng = random.Random(seed)
    words = ["def", "return", "import", "class", "value", "json", "for", "while", "self", "data"]
    work = []
    for i in range(NUM_REQUESTS):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        kind = ["chat", "completion_stream", "grpc", "grpc_stream"][i % 4]
        if kind == "chat":
            messages = [{"role": "user", "content": text}]
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
            work.append((kind, messages, prompt_ids))
        else:
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
            work.append((kind, prompt_ids, prompt_ids))
    return work


def expected_outputs(model, work):
    engine = build_engine(model, PytorchEngineConfig(max_batch_size=NUM_REQUESTS))
    seqs = engine.generate([w[2] for w in work], [SamplingParams(max_new_tokens=MAX_TOKENS)] * len(work))
    return [s.output_token_ids for s in seqs]


def run_one(stack: Stack, kind, payload):
    """Returns (text, token_ids or None, spec_stats dict or None)."""
    base_url = f"http://127.0.0.1:{stack.config.server_port}/v1"
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    if kind == "chat":
        reply = client.chat.completions.create(model=model, messages=payload, max_tokens=MAX_TOKENS,
                                               temperature=0)
        return reply.choices[0].message.content, None, (reply.model_extra or {}).get("spec_stats")
    if kind == "completion_stream":
        chunks = client.completions.create(model=model, prompt=payload, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices), None, None
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=payload), max_tokens=MAX_TOKENS,
            sampling=common_pb2.SamplingParameters(temperature=0.0, top_p=1.0, repetition_penalty=1.0))
        if kind == "grpc":
            reply = stub.Generate(request, timeout=120)
            return reply.text, list(reply.token_ids), None
        text, ids = "", []
        for delta in stub.GenerateStream(request, timeout=120):
            text += delta.text
            ids += list(delta.token_ids)
        return text, ids, None


@pytest.mark.parametrize("method", list(METHODS))
def test_services_greedy_equals_in_process_target(tiny_models, shared_redis, method):
    target_name, draft_name = METHODS[method]
    model = tiny_models[target_name]
    tokenizer = load_tokenizer(model)
    work = make_workload(tokenizer)
    want = expected_outputs(model, work)
    stack = start_stack(model, method, tiny_models[draft_name] if draft_name else None, shared_redis)
    try:
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            results = list(pool.map(lambda w: run_one(stack, w[0], w[1]), work))
    finally:
        stack.stop()
    for i, ((kind, _, _), (text, ids, _), tokens) in enumerate(zip(work, results, want)):
        assert text == tokenizer.decode(tokens, skip_special_tokens=True), f"{method} {kind} request {i}"
        if ids is not None:
            assert ids == tokens, f"{method} {kind} request {i}: token ids differ"


def test_response_format_through_the_openai_client(tiny_models, shared_redis):
    """The seed's OpenAI example with response_format, against the whole stack with speculation;
    the output equals in-process constrained target-only greedy decoding."""
    import json

    from specd.grammar.compiler import GrammarCompilerCache
    from specd.grammar.local import LocalGrammarBackend
    from specd.grammar.response_format import parse_response_format

    model = tiny_models["target-llama"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "age": {"type": "integer"}}, "required": ["name", "age"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    messages = [{"role": "user", "content": "Make up a person"}]
    tokenizer = load_tokenizer(model)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    engine = build_engine(model, PytorchEngineConfig(max_batch_size=1),
                          grammar_backend=LocalGrammarBackend(GrammarCompilerCache.from_model_dir(model)))
    want = engine.generate([prompt_ids], [SamplingParams(max_new_tokens=96)],
                           [parse_response_format(response_format)])[0]
    stack = start_stack(model, "draft_model", tiny_models["draft-llama-small"], shared_redis)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.server_port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        model_name = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model_name, messages=messages, temperature=0,
                                               max_tokens=96, response_format=response_format)
        text = reply.choices[0].message.content
        assert text == tokenizer.decode(want.output_token_ids, skip_special_tokens=True)
        if reply.choices[0].finish_reason == "stop":
            import jsonschema

            jsonschema.validate(json.loads(text), schema)
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                              "properties": 5}}}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model_name, messages=messages, max_tokens=8,
                                           response_format=bad)
        assert "response_format" in str(err.value)
        # vLLM's guided fields are the same constraints, not ignored fields
        guided = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=96,
                                                extra_body={"guided_json": schema})
        assert guided.choices[0].message.content == text
        choices = ["yes", 'say "no"\n']
        picked = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=16,
                                                extra_body={"guided_choice": choices})
        assert picked.choices[0].message.content in choices
        for extra, param in (({"guided_json": schema, "response_format": response_format}, "guided_json"),
                             ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
                             ({"functions": [{"name": "f"}], "tools": [{"type": "function", "function": {
                                 "name": "g"}}]}, "functions"),
                             ({"tool_choice": "required"}, "tool_choice")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, extra_body=extra)
            assert err.value.body["param"].startswith(param), err.value.body
    finally:
        stack.stop()


def test_penalties_and_logit_bias_through_the_stack(tiny_models, shared_redis):
    """presence_penalty, frequency_penalty and logit_bias from the OpenAI client and over gRPC,
    with speculation: the output is in-process target-only greedy decoding with the same settings
    (and differs from decoding without them)."""
    model = tiny_models["target-llama"]
    tokenizer = load_tokenizer(model)
    messages = [{"role": "user", "content": "import json for value in data"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    settings = dict(presence_penalty=1.5, frequency_penalty=0.75, logit_bias={11: 6.0, 12: -100.0})
    engine = build_engine(model, PytorchEngineConfig(max_batch_size=2))
    want, plain = (s.output_token_ids for s in engine.generate(
        [prompt_ids] * 2, [SamplingParams(max_new_tokens=24, **settings), SamplingParams(max_new_tokens=24)]))
    assert want != plain
    stack = start_stack(model, "eagle3", tiny_models["draft-eagle3"], shared_redis)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.server_port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=name, messages=messages, temperature=0, max_tokens=24, presence_penalty=1.5, frequency_penalty=0.75,
            logit_bias={str(t): v for t, v in settings["logit_bias"].items()})
        assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
        with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            sampling = common_pb2.SamplingParameters(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.75,
                                                     logit_bias=settings["logit_bias"])
            got = generate_pb2_grpc.GenerateStub(channel).Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt_ids), max_tokens=24, sampling=sampling), timeout=120)
        assert list(got.token_ids) == want
    finally:
        stack.stop()
