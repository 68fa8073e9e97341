"""Idempotency-Key: a retried request attaches to the one already queued, on any gateway, and a
streamed retry with Last-Event-ID continues after the events the client has. The verifier's side is
the harness's responder, so "queued once" is what it saw."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import redis

from services.gateway.core import GatewayConfig
from specd.transport.redis_streams import cancel_key
# the fixtures by name (pytest finds them in this module; a fixture's own arguments too)
from tests.services.gateway_harness import (  # noqa: F401
    model_dir, tokenizer, reference, responder, services, gateway, base_url, client, MODEL_NAME)

BODY = {"model": MODEL_NAME, "prompt": "import json\nfor value in", "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def other_gateway(services, redis_url, model_dir, responder):
    """A second gateway on the same Redis: where a client retries when its gateway died."""
    server = services.start(GatewayConfig(model=str(model_dir), served_model_name=MODEL_NAME, redis_url=redis_url,
                                          request_timeout=30.0))
    return f"http://127.0.0.1:{server.port}"


def events(response: httpx.Response) -> list[tuple[str | None, dict]]:
    """(id, payload) of each SSE data event but [DONE]."""
    out, event_id = [], None
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((event_id, json.loads(line[6:])))
            event_id = None
    return out


def text_of(payloads) -> str:
    return "".join(p["choices"][0]["text"] for p in payloads if p["choices"])


def test_a_retry_attaches_instead_of_queueing_again(base_url, other_gateway, responder):
    key = {"Idempotency-Key": "retry-1"}
    first = httpx.post(f"{base_url}/v1/completions", json=BODY, headers=key, timeout=30).json()
    seen = len(responder.seen)
    again = httpx.post(f"{other_gateway}/v1/completions", json=BODY, headers=key, timeout=30).json()
    assert len(responder.seen) == seen  # nothing queued the second time
    assert again["id"] == first["id"] and again["created"] == first["created"]
    assert again["choices"] == first["choices"] and again["usage"] == first["usage"]
    plain = httpx.post(f"{base_url}/v1/completions", json=BODY, timeout=30).json()  # no key: a new request
    assert len(responder.seen) == seen + 1 and plain["id"] != first["id"]
    assert plain["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_key_reused_for_another_request_is_refused(base_url):
    key = {"Idempotency-Key": "retry-2"}
    assert httpx.post(f"{base_url}/v1/completions", json=BODY, headers=key, timeout=30).status_code == 200
    other = httpx.post(f"{base_url}/v1/completions", json={**BODY, "max_tokens": 8}, headers=key, timeout=30)
    assert other.status_code == 422 and other.json()["error"]["param"] == "Idempotency-Key"
    bad = httpx.post(f"{base_url}/v1/completions", json=BODY, headers={"Idempotency-Key": "x" * 300}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Idempotency-Key"


def test_a_stream_resumed_with_last_event_id_sends_no_token_twice(base_url, other_gateway, responder):
    """The client reads part of a keyed stream, drops it, and retries on another gateway with the
    id of the last event it has: it gets exactly the rest."""
    key, body = {"Idempotency-Key": "stream-1"}, {**BODY, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=key, timeout=30) as r:
        whole = events(r)
    ids = [int(i) for i, _ in whole]
    assert ids == sorted(ids) and ids[-1] == 24  # each event: the output tokens sent so far
    seen = len(responder.seen)
    cut = len(whole) // 2
    headers = {**key, "Last-Event-ID": whole[cut - 1][0]}
    with httpx.stream("POST", f"{other_gateway}/v1/completions", json=body, headers=headers, timeout=30) as r:
        rest = events(r)
    assert len(responder.seen) == seen
    assert text_of(p for _, p in whole[:cut]) + text_of(p for _, p in rest) == text_of(p for _, p in whole)
    assert [i for i, _ in rest] == [i for i, _ in whole[cut:]]
    with httpx.stream("POST", f"{other_gateway}/v1/completions", json=body, headers=key, timeout=30) as r:
        assert text_of(p for _, p in events(r)) == text_of(p for _, p in whole)  # no id: from the start


def test_a_dropped_keyed_stream_is_not_cancelled(base_url, responder, redis_url):
    """A client that leaves a keyed request mid-stream does not cancel it: its retry reads the
    whole output (without a key, leaving cancels, as before)."""
    key, body = {"Idempotency-Key": "dropped-1"}, {**BODY, "stream": True, "max_tokens": 40}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=key, timeout=30) as r:
        next(r.iter_lines())  # one line, then gone
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=30)
    again = client.completions.create(**{**body, "stream": False}, extra_headers=key)
    assert again.usage.completion_tokens == 40 and again.choices[0].finish_reason == "length"
    request_id = again.id.removeprefix("cmpl-")
    assert redis.Redis.from_url(redis_url).exists(cancel_key(request_id)) == 0  # its verifier was not told to stop


def test_grpc_metadata_key_attaches_the_retry(gateway, responder):
    import grpc

    from specd.v1 import generate_pb2, generate_pb2_grpc

    request = generate_pb2.GenerateRequest(text="import os\nfor path in", max_tokens=12)
    key = (("idempotency-key", "grpc-1"),)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        first = stub.Generate(request, metadata=key, timeout=30)
        seen = len(responder.seen)
        again = stub.Generate(request, metadata=key, timeout=30)
        streamed = list(stub.GenerateStream(request, metadata=key, timeout=30))
        assert len(responder.seen) == seen and again.id == first.id and again.text == first.text
        assert "".join(r.text for r in streamed) == first.text and {r.id for r in streamed} == {first.id}
        with pytest.raises(grpc.RpcError) as info:  # the same key for another request
            stub.Generate(generate_pb2.GenerateRequest(text="other", max_tokens=2), metadata=key, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Idempotency-Key" in info.value.details()


def test_a_retry_queues_what_a_dead_gateway_recorded_but_never_queued(base_url, responder, redis_url):
    """The first gateway recorded the key and died before its XADD: the retry queues the request
    under the recorded id, once."""
    import asyncio

    from services.gateway.idempotency import IdempotencyKeys, fingerprint
    from services.gateway.openai_api import CompletionRequest
    from services.gateway.redis_client import gateway_redis

    body = CompletionRequest(**BODY).model_dump(exclude_unset=True, exclude={"stream", "stream_options"})

    async def record() -> None:
        client = gateway_redis(redis_url)
        try:
            assert await IdempotencyKeys(client).claim("orphan-1", fingerprint("cmpl-", body), ["deadbeef"], 7) is None
        finally:
            await client.aclose()

    asyncio.run(record())
    reply = httpx.post(f"{base_url}/v1/completions", json=BODY, headers={"Idempotency-Key": "orphan-1"}, timeout=30)
    assert reply.status_code == 200
    assert reply.json()["id"] == "cmpl-deadbeef" and reply.json()["created"] == 7 and "deadbeef" in responder.seen
    seen = len(responder.seen)
    again = httpx.post(f"{base_url}/v1/completions", json=BODY, headers={"Idempotency-Key": "orphan-1"}, timeout=30)
    assert again.json()["choices"] == reply.json()["choices"] and len(responder.seen) == seen
