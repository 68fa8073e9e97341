"""docker-compose, for real: the stack is brought up with Debian's docker-compose from images made
here (tests/compose_images.py), served through the OpenAI client, scaled to two verifiers and two
drafters, given 64 requests (spread over both verifiers, each answered once), drained with SIGTERM
and torn down. It carries the `docker` marker and skips without a docker engine.

The compose files themselves are checked by tests/test_compose.py.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

# the fixtures by name (pytest finds them in this module; a fixture's own arguments too)
from tests.compose_images import (  # noqa: F401
    ROOT, sh, docker_engine, base_image, redis_image, specd_image)

NUM_REQUESTS = 64
MAX_TOKENS = 8
LONG_TOKENS = 96


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """One compose project of the stack, driven through docker-compose."""

    def __init__(self, env: dict[str, str]) -> None:
        self.project = f"specdtest{uuid.uuid4().hex[:8]}"
        self.env = env

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return sh("docker-compose", "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"),
                  "-p", self.project, *args, env=self.env, timeout=timeout, check=check)

    def containers(self, service: str) -> list[str]:
        out = self.compose("ps", "-q", service).stdout.decode().split()
        return sorted(out)

    def health(self, container: str) -> str:
        out = sh("docker", "inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{end}}", container)
        return out.stdout.decode().strip()

    def wait_healthy(self, counts: dict[str, int], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            state = {s: [self.health(c) for c in self.containers(s)] for s in counts}
            if all(len(v) == counts[s] and all(h == "healthy" for h in v) for s, v in state.items()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy within {timeout:.0f} s: {state}\n{self.logs()}")
            time.sleep(2)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False).stdout.decode()[-12000:]

    def verifier_stats(self) -> dict[str, int]:
        """consumer name -> requests finished, from each verifier's admin port."""
        return {c: v[0] for c, v in self.verifier_counts().items()}

    def verifier_counts(self) -> dict[str, tuple[int, int]]:
        """consumer name -> (finished, running), both read in one Stats call per verifier."""
        probe = ("import grpc, json; from specd.v1 import verifier_pb2 as p, verifier_pb2_grpc as g; "
                 "s = g.VerifierAdminStub(grpc.insecure_channel('127.0.0.1:50071'))"
                 ".Stats(p.VerifierStatsRequest(), timeout=10); "
                 "print(json.dumps([s.consumer, s.num_finished, s.num_running]))")
        stats = {}
        for c in self.containers("verifier"):
            consumer, num_finished, num_running = json.loads(sh("docker", "exec", c, "python3", "-c", probe).stdout)
            stats[consumer] = (num_finished, num_running)
        return stats


@pytest.fixture(scope="module")
def stack(specd_image, redis_image):
    http_port = free_port()
    env = {"SPECD_IMAGE": specd_image, "REDIS_IMAGE": redis_image, "SPECD_BIND_ADDRESS": "127.0.0.1",
           "SPECD_HTTP_PORT": str(http_port), "SPECD_GRPC_PORT": str(free_port()),
           # A batch of 8 per verifier: 64 requests at once cannot all land on the first verifier
           # that reads the stream, as they would with room for 64.
           "SPECD_MAX_BATCH_SIZE": "8"}
    s = Stack(env)
    s.http_port = http_port
    t0 = time.monotonic()
    try:
        s.compose("up", "-d", "--no-build", timeout=900)
        s.wait_healthy({"gateway": 1, "verifier": 1, "drafter": 1, "grammar": 1})
        print(f"\nstack {s.project} up and healthy in {time.monotonic() - t0:.0f} s")
        yield s
    finally:
        s.compose("down", "-v", "--remove-orphans", "-t", "30", timeout=300, check=False)


def client(stack: Stack):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="none",
                         timeout=300, max_retries=0)


@pytest.mark.docker
def test_compose_stack_serves_scales_and_drains(stack):
    oai = client(stack)
    model = oai.models.list().data[0].id
    # Plain, streamed and structured requests through the OpenAI client, one verifier.
    reply = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens > 0
    chunks = list(oai.completions.create(model=model, prompt="Shanghai is", max_tokens=MAX_TOKENS,
                                         stream=True, temperature=0))
    assert "".join(c.choices[0].text for c in chunks if c.choices) and chunks
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    structured = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a number"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    if structured.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(structured.choices[0].message.content)["n"], int)

    # Scale out: two verifiers in one consumer group, two drafters behind one DNS name.
    t0 = time.monotonic()
    stack.compose("up", "-d", "--no-build", "--scale", "verifier=2", "--scale", "drafter=2", timeout=900)
    stack.wait_healthy({"gateway": 1, "verifier": 2, "drafter": 2, "grammar": 1})
    print(f"\nscaled to 2 verifiers + 2 drafters in {time.monotonic() - t0:.0f} s")
    newest = max(stack.containers("verifier"),
                 key=lambda c: sh("docker", "inspect", "-f", "{{.Created}}", c).stdout.decode())
    resolved = [line for line in sh("docker", "logs", newest).stderr.decode().splitlines()
                if "drafters resolved" in line]
    found = re.findall(r'addresses="?([^" ]+)', resolved[-1]) if resolved else []
    assert found and len(found[0].split(",")) == 2, f"the new verifier found {resolved}"

    before = stack.verifier_stats()
    assert len(before) == 2
    prompts = [f"request {i}: tell me about {i}" for i in range(NUM_REQUESTS)]

    def ask(prompt: str):
        r = oai.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                   extra_body={"ignore_eos": True})
        return r.id, r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(ask, prompts))
    elapsed = time.monotonic() - t0
    after = stack.verifier_stats()
    served = {c: after[c] - before.get(c, 0) for c in after}
    print(f"\n{NUM_REQUESTS} requests in {elapsed:.1f} s; finished per verifier: {served}")
    assert len({a[0] for a in answers}) == NUM_REQUESTS  # one answer per request
    assert all(a[2] == "length" and a[3] == MAX_TOKENS for a in answers), answers
    assert sum(served.values()) == NUM_REQUESTS, served  # each request finished once, by one verifier
    assert all(n > 0 for n in served.values()), f"not spread over both verifiers: {served}"
    # Nothing left pending in the consumer group: every entry was acknowledged.
    redis_container = stack.containers("redis")[0]
    pending = sh("docker", "exec", redis_container, "redis-cli", "XPENDING", "specd:requests", "verifiers")
    assert pending.stdout.decode().split()[0] == "0", pending.stdout.decode()

    # SIGTERM drains: a verifier stops admitting, finishes the requests it runs, then exits 0.
    # Long requests, so that they are still decoding when the signal arrives.
    def ask_long(prompt: str):
        r = oai.completions.create(model=model, prompt=prompt, max_tokens=LONG_TOKENS, temperature=0,
                                   extra_body={"ignore_eos": True})
        return r.choices[0].finish_reason, r.usage.completion_tokens

    finished = sum(stack.verifier_stats().values())
    with ThreadPoolExecutor(max_workers=8) as pool:
        late = [pool.submit(ask_long, f"late {i}") for i in range(8)]
        # Wait until all 8 are admitted (a request still queued at SIGTERM is rightly left for
        # another verifier) and at least one is still decoding.
        deadline = time.monotonic() + 120
        while True:
            counts = stack.verifier_counts().values()
            running, done = sum(c[1] for c in counts), sum(c[0] for c in counts) - finished
            if running + done == 8 and running > 0:
                break
            assert time.monotonic() < deadline and running + done <= 8, (running, done)
            time.sleep(0.2)
        victims = stack.containers("verifier")
        stack.compose("stop", "-t", "120", "verifier", timeout=300)
        codes = [sh("docker", "inspect", "-f", "{{.State.ExitCode}}", c).stdout.decode().strip() for c in victims]
        assert codes == ["0", "0"], f"verifier exit codes after SIGTERM: {codes}\n{stack.logs()}"
        # Every verifier is gone now, so whatever was answered was finished by the drain.
        assert [f.result(timeout=60) for f in late] == [("length", LONG_TOKENS)] * 8
