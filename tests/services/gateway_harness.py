"""The gateway tests' harness: a test-local verifier (Responder), the loop the in-process gateways
run on (ServiceLoop) and the module-scoped fixtures test_gateway.py and test_gateway_grpc.py share.

The verifier's side of the Redis contract is played by a test-local responder thread: it
XREADGROUPs the request stream and answers with delta/final entries computed by a real in-process
engine (ngram speculation, greedy, so its tokens are the target's own and its spec_stats are real),
re-sending overlapping deltas on purpose so that delivery must be exactly-once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import openai
import pytest
import redis

from services.gateway.core import GatewayConfig
from services.gateway.server import GatewayServer
from specd.messages import ConfigError, SpeculativeConfig
from specd.sampling_params import SamplingParams
from specd.transport.redis_streams import CONSUMER_GROUP, RESULT_TTL_SECONDS, QueuedRequest, ResultEntry, result_key
from specd.v1 import generate_pb2_grpc


MODEL_NAME = "tiny-llama"
REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- the verifier's side of the contract ----------------------------------------------------------
class Responder(threading.Thread):
    """Plays a verifier: reads the request stream, writes deltas (with duplicates) and a final entry."""

    def __init__(self, redis_url: str, stream: str, engine, tokenizer, chunk: int = 3) -> None:
        super().__init__(daemon=True, name="test-responder")
        self.client = redis.Redis.from_url(redis_url)
        self.stream = stream
        self.engine = engine
        self.tokenizer = tokenizer
        self.chunk = chunk
        self.seen: dict[str, QueuedRequest] = {}
        self.abandoned: set[str] = set()  # by tests that disconnect
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            self.client.xgroup_create(self.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError:
            pass  # BUSYGROUP
        while not self.stop_event.is_set():
            try:
                reply = self.client.xreadgroup(CONSUMER_GROUP, "responder", {self.stream: ">"}, count=4, block=50)
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        self.answer(QueuedRequest.from_fields(fields))
                        self.client.xack(self.stream, CONSUMER_GROUP, entry_id)
                        self.client.xdel(self.stream, entry_id)
            except Exception as e:  # surfaced by the fixture's teardown
                self.errors.append(e)
                time.sleep(0.05)

    def write(self, request_id: str, entry: ResultEntry) -> None:
        key = result_key(request_id)
        with self.client.pipeline() as pipe:
            pipe.xadd(key, entry.to_fields())
            pipe.expire(key, RESULT_TTL_SECONDS)
            pipe.execute()

    def answer(self, req: QueuedRequest) -> None:
        self.seen[req.request_id] = req
        rid = req.request_id
        if "TRIGGER_ERROR" in self.tokenizer.decode(req.prompt_token_ids):
            self.write(rid, ResultEntry(kind="error", code=422, message="the verifier refused TRIGGER_ERROR"))
            return
        try:
            seq = self.engine.generate([req.prompt_token_ids], [req.params])[0]
        except ConfigError as e:
            self.write(rid, ResultEntry(kind="error", code=400, message=str(e)))
            return
        tokens = seq.output_token_ids
        last = max(1, len(tokens) % self.chunk or self.chunk)
        body = tokens[:-last]
        for i, pos in enumerate(range(0, len(body), self.chunk)):
            piece = body[pos:pos + self.chunk]
            self.write(rid, ResultEntry(kind="delta", pos=pos, tokens=piece))
            if i % 2 == 1:  # an overlapping re-send, as a resumed verifier would write
                back = max(0, pos - self.chunk)
                self.write(rid, ResultEntry(kind="delta", pos=back, tokens=body[back:pos + len(piece)]))
            time.sleep(0.002)
        if body:
            self.write(rid, ResultEntry(kind="delta", pos=0, tokens=body))  # a full duplicate
        self.write(rid, ResultEntry(kind="final", pos=len(body), tokens=tokens[len(body):],
                                    finish_reason=seq.finish_reason, spec_stats=seq.stats,
                                    prompt_tokens=len(req.prompt_token_ids)))


class ServiceLoop:
    """One background asyncio loop that runs every in-process gateway of this module."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="gateway-loop")
        self.thread.start()
        self.running: list[tuple[GatewayServer, object]] = []

    def start(self, config: GatewayConfig, grace_s: float = 1.0) -> GatewayServer:
        server = GatewayServer(config, host="127.0.0.1", port=0, grpc_port=0, grace_s=grace_s, access_log=False,
                               log_level="warning")
        future = asyncio.run_coroutine_threadsafe(server.serve(install_signal_handlers=False), self.loop)
        deadline = time.monotonic() + 30
        while not server.ready.wait(0.05):
            if future.done():
                future.result()
            assert time.monotonic() < deadline, "gateway did not start"
        self.running.append((server, future))
        return server

    def stop(self, server: GatewayServer) -> None:
        future = next(f for s, f in self.running if s is server)
        self.running.remove((server, future))
        server.shutdown()
        future.result(timeout=20)

    def close(self) -> None:
        for server, _ in list(self.running):
            self.stop(server)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_models) -> Path:
    return tiny_models["target-llama"]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from specd.models.loader import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Target-only greedy tokens: the truth the gateway's outputs are checked against."""
    from specd.engine.builder import build_engine

    engine = build_engine(model_dir)

    def generate(prompt_ids: list[int], max_tokens: int, **params) -> list[int]:
        return engine.generate([prompt_ids], [SamplingParams(max_new_tokens=max_tokens, **params)])[0].output_token_ids
    return generate


@pytest.fixture(scope="module")
def responder(redis_url, model_dir, tokenizer):
    from specd.engine.builder import build_engine

    # Fixed k: the same request answered twice carries the same speculation figures (adaptive
    # draft lengths follow measured step times).
    engine = build_engine(model_dir, speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                                          adaptive=False),
                          tokenizer=tokenizer)
    thread = Responder(redis_url, "specd:requests", engine, tokenizer)
    thread.start()
    yield thread
    thread.stop_event.set()
    thread.join(timeout=5)
    assert not thread.errors, thread.errors


@pytest.fixture(scope="module")
def services():
    loop = ServiceLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def gateway(services, redis_url, model_dir, responder) -> GatewayServer:
    return services.start(GatewayConfig(model=str(model_dir), served_model_name=MODEL_NAME, redis_url=redis_url,
                                        max_queue_depth=64, request_timeout=30.0, enable_metrics=True))


@pytest.fixture(scope="module")
def base_url(gateway) -> str:
    return f"http://127.0.0.1:{gateway.port}"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def stub(gateway):
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}")
    yield generate_pb2_grpc.GenerateStub(channel)
    channel.close()


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fibonacci(n):"}]
