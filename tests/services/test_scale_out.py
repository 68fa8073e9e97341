"""Two verifiers and two drafters on one Redis: every request answered once, both verifiers work,
and the acceptance counters on /metrics agree with the per-request stats of the same run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import redis

from specd.engine.builder import build_engine
from specd.messages import PytorchEngineConfig
from specd.sampling_params import SamplingParams
from specd.transport.embedded_redis import start_embedded_redis
from specd.transport.ports import free_port
from specd.v1 import verifier_pb2, verifier_pb2_grpc

NUM_REQUESTS = 64
MAX_TOKENS = 10


def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specd.cli", *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})


def wait_until(check, procs, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a service exited early: {p.args}\n{p.stderr.read().decode()[-3000:]}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise TimeoutError("services did not become ready")


def grpc_healthy(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def metric_sum(text: str, name: str) -> float:
    """Sum of a metric's samples over all label sets (`name` without `_total`)."""
    pattern = re.compile(rf"^(?:specd:)?{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


@pytest.fixture(scope="module")
def stack(tiny_models):
    target, draft = tiny_models["target-llama"], tiny_models["draft-eagle3"]
    server = start_embedded_redis()
    procs: list[subprocess.Popen] = []
    drafters = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    admins = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    metrics_ports = [free_port() for _ in range(2)]
    http_port, grpc_port = free_port(), free_port()
    try:
        for address in drafters:
            procs.append(spawn(["drafter", str(target), "--speculative-algorithm", "eagle3",
                                "--speculative-draft-model", str(draft), "--host", "127.0.0.1",
                                "--port", address.split(":")[1]]))
        wait_until(lambda: all(grpc_healthy(a) for a in drafters), procs)
        for i, (admin, mport) in enumerate(zip(admins, metrics_ports)):
            procs.append(spawn(["verifier", str(target), "--redis-url", server.url, "--consumer", f"verifier-{i}",
                                "--drafter", ",".join(drafters), "--speculative-algorithm", "eagle3",
                                "--speculative-num-draft-tokens", "3", "--max-batch-size", "8",
                                "--admin-port", admin.split(":")[1], "--metrics-port", str(mport)]))
        procs.append(spawn(["gateway", str(target), "--host", "127.0.0.1", "--port", str(http_port),
                            "--grpc-port", str(grpc_port), "--redis-url", server.url, "--enable-metrics"]))
        wait_until(lambda: all(grpc_healthy(a) for a in admins), procs)
        wait_until(lambda: urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=1).status == 200,
                   procs)
        yield {"http": http_port, "admins": admins, "metrics": metrics_ports, "redis": server.url,
               "target": target}
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        server.stop()


def test_two_verifiers_two_drafters_answer_everything_once(stack):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack['http']}/v1", api_key="x", max_retries=0,
                           timeout=180)
    model = client.models.list().data[0].id
    prompts = [[5 + (i % 40), 7 + (i % 13), 9 + (i % 7), 11 + i % 5] * (1 + i % 3) for i in range(NUM_REQUESTS)]
    want = build_engine(stack["target"], PytorchEngineConfig(max_batch_size=NUM_REQUESTS)).generate(
        prompts, [SamplingParams(max_new_tokens=MAX_TOKENS)] * NUM_REQUESTS)

    def one(prompt):
        return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        replies = list(pool.map(one, prompts))
    from specd.models.loader import load_tokenizer

    tokenizer = load_tokenizer(stack["target"])
    for reply, seq in zip(replies, want):
        assert reply.choices[0].text == tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    assert len({r.id for r in replies}) == NUM_REQUESTS

    # Each verifier served some; together exactly NUM_REQUESTS (nothing served twice).
    finished = []
    for admin in stack["admins"]:
        with grpc.insecure_channel(admin) as ch:
            finished.append(verifier_pb2_grpc.VerifierAdminStub(ch).Stats(
                verifier_pb2.VerifierStatsRequest(), timeout=5).num_finished)
    print(f"requests finished per verifier: {finished}")
    assert all(n > 0 for n in finished) and sum(finished) == NUM_REQUESTS
    r = redis.Redis.from_url(stack["redis"])
    assert r.xlen("specd:requests") == 0
    assert r.xpending("specd:requests", "verifiers")["pending"] == 0

    # /metrics (gateway, and the two verifiers together) agree with the per-request stats.
    stats = [r.model_extra["spec_stats"] for r in replies]
    totals = {k: sum(s[k] for s in stats) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    gateway_metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack['http']}/metrics").read().decode()
    verifier_metrics = "\n".join(urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics").read().decode()
                                 for p in stack["metrics"])
    for text in (gateway_metrics, verifier_metrics):
        assert metric_sum(text, "spec_decode_num_drafts") == totals["num_drafts"]
        assert metric_sum(text, "spec_decode_num_draft_tokens") == totals["num_draft_tokens"]
        assert metric_sum(text, "spec_decode_num_accepted_tokens") == totals["num_accepted_tokens"]
    per_position = [sum(s["accepted_per_position"][i] if i < len(s["accepted_per_position"]) else 0
                        for s in stats) for i in range(3)]
    assert metric_sum(gateway_metrics, "spec_decode_num_accepted_tokens_per_pos") == sum(per_position)
    assert totals["num_draft_tokens"] > 0
