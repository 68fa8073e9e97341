"""Load at twice the configured capacity: quick 429s, no timeouts, nothing accepted is lost.

The stack (gateway, verifier, grammar) admits at most MAX_QUEUE_DEPTH requests queued or running
(the gateway's atomic XLEN-check-and-XADD). 2 x MAX_QUEUE_DEPTH clients send greedy completions
back to back for a while; a 429 is retried after a short pause. Every accepted request must come
back with exactly the target's own greedy tokens, and every 429 must come back fast.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import redis

from services.launcher.supervisor import Stack, StackConfig
from specd.transport.ports import free_port

MAX_QUEUE_DEPTH = 8
NUM_CLIENTS = 2 * MAX_QUEUE_DEPTH
DURATION_S = 20.0
MAX_TOKENS = 16
PROMPTS = ["def add(a, b):", "import json\n", "class Stack:", "for i in range("]


@pytest.fixture(scope="module")
def stack(tiny_models, redis_url):
    config = StackConfig(model=str(tiny_models["target-llama"]), server_name="127.0.0.1", server_port=free_port(),
                         grpc_port=free_port(), redis_url=redis_url, max_batch_size=4,
                         max_queue_depth=MAX_QUEUE_DEPTH, request_timeout=120)
    running = Stack(config)
    try:
        running.start(timeout=240)
        yield running
    finally:
        running.stop()


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def test_twice_the_capacity_gets_429s_and_loses_nothing(stack, tiny_models, redis_url):
    from specd.engine.builder import build_engine
    from specd.models.loader import load_tokenizer
    from specd.sampling_params import SamplingParams

    model = tiny_models["target-llama"]
    tokenizer = load_tokenizer(model)
    engine = build_engine(model)
    expected = {p: tokenizer.decode(engine.generate([tokenizer.encode(p)], [SamplingParams(
        max_new_tokens=MAX_TOKENS, ignore_eos=True)])[0].output_token_ids, skip_special_tokens=True) for p in PROMPTS}

    lock = threading.Lock()
    accepted_latency: list[float] = []
    rejected_latency: list[float] = []
    wrong: list[str] = []
    lost: list[str] = []  # accepted (or maybe accepted) but not answered: timeouts, errors
    stop_at = time.monotonic() + DURATION_S

    def client_loop(i: int) -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.server_port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        n = 0
        while time.monotonic() < stop_at:
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            n += 1
            t0 = time.perf_counter()
            try:
                reply = client.completions.create(model=str(model), prompt=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body={"ignore_eos": True})
            except openai.RateLimitError as e:
                with lock:
                    rejected_latency.append(time.perf_counter() - t0)
                assert e.response.headers["retry-after"] == "1" and e.body["code"] == "queue_full"
                time.sleep(0.1)  # a real client waits Retry-After; a short pause keeps the pressure on
                continue
            except Exception as e:  # timeouts, 5xx: an accepted request that was not answered
                with lock:
                    lost.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                accepted_latency.append(time.perf_counter() - t0)
                if reply.choices[0].text != expected[prompt] or reply.usage.completion_tokens != MAX_TOKENS:
                    wrong.append(prompt)

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        list(pool.map(client_loop, range(NUM_CLIENTS)))

    r = redis.Redis.from_url(redis_url)
    print(f"\nload at {NUM_CLIENTS} clients for capacity {MAX_QUEUE_DEPTH}, {DURATION_S:.0f} s: "
          f"accepted {len(accepted_latency)}, 429 {len(rejected_latency)}, lost {len(lost)}, wrong {len(wrong)}; "
          f"accepted latency p50 {percentile(accepted_latency, 0.5):.3f} s p99 {percentile(accepted_latency, 0.99):.3f} s; "
          f"429 latency p50 {percentile(rejected_latency, 0.5) * 1e3:.1f} ms "
          f"p99 {percentile(rejected_latency, 0.99) * 1e3:.1f} ms max {max(rejected_latency, default=0) * 1e3:.1f} ms")
    assert lost == [] and wrong == []
    assert len(accepted_latency) >= 2 * MAX_QUEUE_DEPTH and len(rejected_latency) > len(accepted_latency) // 4
    # A 429 is one Lua call in Redis: it must not wait behind the queue (accepted requests take seconds).
    assert percentile(rejected_latency, 0.99) < min(1.0, statistics.median(accepted_latency))
    assert r.xlen("specd:requests") == 0  # every accepted entry was answered and removed
