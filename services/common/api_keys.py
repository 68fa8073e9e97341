"""API keys, as lmdeploy's `api_server --api-keys` has them: `Authorization: Bearer KEY`.

HTTP routes that generate or list models need a valid key (401 otherwise); /health and /metrics
stay open, as in lmdeploy (probes and Prometheus carry no key). On gRPC the same key travels as
`authorization: Bearer KEY` metadata (UNAUTHENTICATED otherwise); grpc.health.v1 and reflection
stay open. No keys configured: everything is open.

Keys come from the command line (`--api-keys K1 K2`, or one comma-separated string as lmdeploy
accepts) or from the SPECD_API_KEYS environment variable (comma-separated), which keeps them out
of `ps` output; the launcher hands them to the gateway that way.
"""

from __future__ import annotations

import hmac

import grpc

from specd import settings

INVALID_KEY_MESSAGE = "Please request with valid api key!"  # lmdeploy's words, so clients see the same

# Services that answer without a key: probes and tooling.
OPEN_GRPC_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                      "grpc.reflection.v1.ServerReflection")


class ApiKeys:
    """The accepted keys; `is_valid` compares in constant time so the check leaks no key prefix."""

    def __init__(self, keys=()) -> None:
        self.keys = tuple(k.encode() for k in parse_keys(keys))

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def is_valid(self, key: str | None) -> bool:
        if not self.enabled:
            return True
        if not key:
            return False
        given = key.encode(errors="surrogateescape")
        # compare_digest against every key (no early exit): timing says nothing about which matched.
        return sum(hmac.compare_digest(given, k) for k in self.keys) > 0

    def is_valid_authorization(self, header: str | None) -> bool:
        """`Bearer KEY` (scheme case-insensitive, as RFC 6750)."""
        scheme, _, key = (header or "").strip().partition(" ")
        return self.is_valid(key.strip() if scheme.lower() == "bearer" else None)


def parse_keys(keys) -> list[str]:
    """Keys from a list (each item may itself be comma-separated) or one string; blanks dropped."""
    if isinstance(keys, str):
        keys = [keys]
    return [k.strip() for item in keys or () for k in item.split(",") if k.strip()]


def keys_from_env() -> list[str]:
    return parse_keys(settings.API_KEYS.get())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid `authorization: Bearer KEY` with UNAUTHENTICATED."""

    def __init__(self, keys: ApiKeys, open_services: tuple[str, ...] = OPEN_GRPC_SERVICES) -> None:
        self.keys = keys
        self.open_prefixes = tuple(f"/{s}/" for s in open_services)

    async def intercept_service(self, continuation, handler_call_details):
        if not self.keys.enabled or handler_call_details.method.startswith(self.open_prefixes):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.keys.is_valid_authorization(metadata.get("authorization")):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that aborts; it takes raw bytes, so a garbled body changes nothing."""
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, INVALID_KEY_MESSAGE)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, INVALID_KEY_MESSAGE)
        yield  # an async generator, as streaming handlers are

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, None, handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, None, handler.response_serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, None, handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, None, handler.response_serializer)
