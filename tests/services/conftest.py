"""Fixtures for service tests: a real Redis server on loopback."""

from __future__ import annotations

import pytest

from specd.transport.embedded_redis import start_embedded_redis


@pytest.fixture(scope="module")
def redis_url():
    server = start_embedded_redis()
    yield server.url
    server.stop()
