"""usage.prompt_tokens_details.cached_tokens: the prompt tokens the verifier found in its prefix
cache, through the whole stack and the OpenAI client, whole and streamed."""

from __future__ import annotations

import openai

from tests.services.test_e2e import start_stack

SYSTEM = "You write Python. " * 40  # several blocks, shared by every request below


def test_a_repeated_prompt_reports_its_cached_tokens(tiny_models, redis_url):
    stack = start_stack(tiny_models["target-llama"], "ngram", None, redis_url)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.server_port}/v1", api_key="x",
                               max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def f():"}]
        first = client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0)
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0  # whole blocks
        usage = None
        for chunk in client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
        assert usage.prompt_tokens_details.cached_tokens == cached
        off = client.completions.create(model=name, prompt="unrelated text", max_tokens=2)
        assert off.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        stack.stop()
