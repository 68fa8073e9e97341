"""Fixtures for service tests: a real Redis server on loopback, a client of it, the tiny target,
an n-gram drafter service, a grammar service (and `_allowed`, which reads its mask rows)."""

from __future__ import annotations

import pytest

from specd.transport.embedded_redis import start_embedded_redis


@pytest.fixture(scope="module")
def redis_url():
    server = start_embedded_redis()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def client(redis_url):
    import redis

    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def target(tiny_models):
    """The tiny Llama target most service tests serve."""
    return tiny_models["target-llama"]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread, and the service subprocesses share the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ngram_drafter(tiny_models):
    """A real n-gram drafter service on loopback (gRPC and its fast step port), k up to 8."""
    from services.drafter.server import load_drafter, start_server
    from specd.messages import SpeculativeConfig

    target = tiny_models["target-llama"]
    servicer = load_drafter(target, SpeculativeConfig(method="ngram", num_speculative_tokens=3), target,
                            max_num_draft_tokens=8)
    server = start_server(servicer, "127.0.0.1", 0, max_workers=4)
    yield server
    server.stop(0.5)


@pytest.fixture(scope="module")
def eagle3_drafter(tiny_models):
    """A real EAGLE-3 drafter service (the tiny head) on loopback, gRPC and its fast step port."""
    from services.drafter.server import load_drafter, start_server
    from specd.messages import SpeculativeConfig

    target = tiny_models["target-llama"]
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, model=str(tiny_models["draft-eagle3"]))
    server = start_server(load_drafter(target, spec, target, max_num_draft_tokens=8), "127.0.0.1", 0, max_workers=4)
    yield server
    server.stop(0.5)


@pytest.fixture(scope="module")
def grammar_server(tiny_models):
    """A real grammar service on loopback for the tiny Llama target (test_grammar_service*.py)."""
    from services.grammar.server import load_grammar, start_server

    server = start_server(load_grammar(tiny_models["target-llama"]), host="127.0.0.1")
    yield server
    server.stop(0)


def _allowed(row: torch.Tensor, vocab_size: int) -> list[int]:
    """Token ids a [W] int32 bitmask row allows."""
    import torch

    bits = (row.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()
