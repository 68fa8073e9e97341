"""Fixtures for service tests: a real Redis server on loopback."""

from __future__ import annotations

import pytest

from specd.transport.embedded_redis import start_embedded_redis


@pytest.fixture(scope="module")
def redis_url():
    server = start_embedded_redis()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread, and the service subprocesses share the cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
