"""The gRPC front end (specd.v1.Generate), served by the gateway's process next to the HTTP API.

A thin servicer: protobuf in, the Gateway core, protobuf out. Errors are mapped to status codes by
one interceptor (the same GatewayError the HTTP handlers map to status codes); it also parses the
request itself, so that bytes that are no GenerateRequest get INVALID_ARGUMENT, not UNKNOWN. API
keys are checked first (UNAUTHENTICATED). The server also answers grpc.health.v1 and server
reflection, with no key.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from google.protobuf.message import DecodeError

from specd.messages import ConfigError, SpecStats
from specd.sampling_params import SamplingParams
from specd.transport.redis_streams import QueuedRequest
from specd.v1 import common_pb2, generate_pb2, generate_pb2_grpc

from services.common.api_keys import ApiKeyInterceptor
from services.common.grpc_server import NO_PORT_SHARING
from services.common.tls import add_port
from services.gateway.core import Gateway, collect, first_output
from services.gateway.idempotency import METADATA as IDEMPOTENCY_METADATA, check_key, fingerprint
from services.gateway.errors import REDIS_ERRORS, GatewayError, redis_unavailable
from services.gateway.request_stream import RequestTimings
from services.gateway.validation import MAX_STOP_WORDS

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name

_FINISH_REASONS = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}

_STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                 409: grpc.StatusCode.ABORTED, 422: grpc.StatusCode.INVALID_ARGUMENT,
                 429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
                 501: grpc.StatusCode.UNIMPLEMENTED, 503: grpc.StatusCode.UNAVAILABLE,
                 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC status code for an HTTP-like status."""
    if status in _STATUS_CODES:
        return _STATUS_CODES[status]
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= status < 500 else grpc.StatusCode.INTERNAL


def _as_gateway_error(exc: BaseException) -> GatewayError | None:
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, ConfigError):
        return GatewayError(400, str(exc))
    if isinstance(exc, REDIS_ERRORS):
        return redis_unavailable(exc)
    return None


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps GatewayError (and config / Redis errors) to status codes with readable messages.

    The wrapped handlers receive raw bytes and parse them here: grpc would answer a message that
    does not parse with UNKNOWN, which reads as a server fault.
    """

    def __init__(self, services: tuple[str, ...] = (SERVICE_NAME,)) -> None:
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefixes):
            return handler
        parse = handler.request_deserializer or (lambda raw: raw)
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary_unary(raw, context):
                try:
                    return await inner_unary(_parse(parse, raw), context)
                except Exception as e:
                    await _abort(context, e)

            return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def unary_stream(raw, context):
                try:
                    async for response in inner_stream(_parse(parse, raw), context):
                        yield response
                except Exception as e:
                    await _abort(context, e)

            return grpc.unary_stream_rpc_method_handler(unary_stream, None, handler.response_serializer)
        return handler


def _parse(parse, raw: bytes):
    try:
        return parse(raw)
    except DecodeError as e:  # corrupt wire format, a string field that is not UTF-8, ...
        raise GatewayError(400, f"the request is not a valid protobuf message: {e}") from None


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    error = _as_gateway_error(exc)
    if error is None:
        if isinstance(exc, grpc.aio.AbortError):
            raise exc
        logger.exception("unhandled error in the Generate servicer")
        error = GatewayError(500, f"internal error: {type(exc).__name__}")
    metadata = (("retry-after", str(error.retry_after)),) if error.retry_after is not None else ()
    await context.abort(grpc_code(error.status), error.message, trailing_metadata=metadata)


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    """specd.v1.Generate over the Gateway core."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Generate(self, request: generate_pb2.GenerateRequest, context) -> generate_pb2.GenerateResponse:
        stream = await self._submit(request, context)
        result = await collect(stream)
        return generate_pb2.GenerateResponse(
            id=result.request_id, text=result.text, token_ids=result.token_ids,
            finish_reason=_FINISH_REASONS.get(result.finish_reason, generate_pb2.FINISH_REASON_UNSPECIFIED),
            usage=_usage(result.num_prompt_tokens, len(result.token_ids), result.time_to_first_token,
                         result.latency),
            spec_stats=_spec_stats_pb(result.spec_stats))

    async def GenerateStream(self, request: generate_pb2.GenerateRequest,
                             context) -> AsyncIterator[generate_pb2.GenerateStreamResponse]:
        stream = await self._submit(request, context)
        first = await first_output(stream)  # errors before the first token end the call with a status
        try:
            out = first
            while out is not None:
                response = generate_pb2.GenerateStreamResponse(id=stream.request_id, text=out.text,
                                                                token_ids=out.token_ids)
                if out.finish_reason is not None:
                    response.finish_reason = _FINISH_REASONS.get(out.finish_reason,
                                                                 generate_pb2.FINISH_REASON_UNSPECIFIED)
                    response.usage.CopyFrom(_usage(stream.num_prompt_tokens, len(stream.token_ids),
                                                   stream.timings.time_to_first_token, stream.timings.latency))
                    response.spec_stats.CopyFrom(_spec_stats_pb(out.spec_stats))
                yield response
                out = await anext(stream, None)
        finally:
            stream.abandon("client cancelled")  # a no-op when the request finished

    async def _submit(self, request: generate_pb2.GenerateRequest, context):
        timings = RequestTimings()
        # The client's gRPC deadline, when shorter than the gateway's limit, is the request's deadline.
        timeout_s = context.time_remaining() or self.gateway.config.request_timeout
        queued = await self.to_queued_request(request, timeout_s)
        key = dict(context.invocation_metadata() or ()).get(IDEMPOTENCY_METADATA)
        if key is None:
            return await self.gateway.submit(queued, timings, timeout_s)
        # The HTTP header's twin (idempotency.py): a retry reads the request the first call queued.
        keys = self.gateway.idempotency
        request_print = fingerprint("grpc", {"request": request.SerializeToString(deterministic=True).hex()})
        earlier = await keys.claim(check_key(key), request_print, [queued.request_id], int(time.time()))
        if earlier is not None:
            queued.request_id = earlier.request_ids[0]
        try:
            return await self.gateway.submit(queued, timings, timeout_s, idempotency_key=key)
        except BaseException:
            if earlier is None:
                await keys.release(key)
            raise

    async def to_queued_request(self, request: generate_pb2.GenerateRequest,
                                timeout_s: float | None = None) -> QueuedRequest:
        """Validate and tokenize (raises GatewayError with the field named)."""
        g = self.gateway
        g.check_model(request.model)
        timeout_s = min(timeout_s or g.config.request_timeout, g.config.request_timeout)
        which = request.WhichOneof("input")
        if which == "text":
            prompt = await g.encode_text(request.text)
        elif which == "chat":
            prompt = await g.encode_chat([{"role": m.role, "content": m.content} for m in request.chat.messages])
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise GatewayError(400, "input: set one of text, chat or token_ids", param="input")
        if len(request.stop) > MAX_STOP_WORDS or len(request.stop_token_ids) > MAX_STOP_WORDS:
            raise GatewayError(400, f"stop, stop_token_ids: at most {MAX_STOP_WORDS} each", param="stop")
        if request.max_tokens < 0:
            raise GatewayError(400, f"max_tokens: must be >= 0, got {request.max_tokens}", param="max_tokens")
        max_tokens = g.check_prompt(prompt, request.max_tokens or None)
        response_format = None
        if request.response_format_json:
            try:
                response_format = json.loads(request.response_format_json)
            except (json.JSONDecodeError, RecursionError) as e:
                raise GatewayError(400, f"response_format_json: not JSON ({e})", param="response_format_json")
            if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
                raise GatewayError(400, "response_format_json: expected an object with a 'type'",
                                   param="response_format_json")
            g.check_values({"response_format_json": response_format})
            if response_format["type"] == "text":
                response_format = None
        return QueuedRequest(request_id=g.new_request_id(), prompt_token_ids=prompt,
                             params=self.to_sampling_params(request, max_tokens), model=g.model_name,
                             response_format=response_format,
                             deadline=time.time() + timeout_s)

    @staticmethod
    def to_sampling_params(request: generate_pb2.GenerateRequest, max_tokens: int) -> SamplingParams:
        s = request.sampling
        try:
            # top_p 0 means greedy, as on HTTP (openai_api.to_sampling_params); unset means 1.
            greedy = s.temperature == 0.0 or (s.HasField("top_p") and s.top_p == 0.0)
            return SamplingParams(
                temperature=0.0 if greedy else float(s.temperature), top_k=int(s.top_k),
                top_p=float(s.top_p) if s.HasField("top_p") and not greedy else 1.0,
                min_p=float(s.min_p), repetition_penalty=float(s.repetition_penalty) or 1.0,
                presence_penalty=float(s.presence_penalty), frequency_penalty=float(s.frequency_penalty),
                logit_bias={int(t): float(v) for t, v in s.logit_bias.items()},
                seed=(int(s.seed) if request.has_seed else random.getrandbits(62)) % (2**63),
                max_new_tokens=max_tokens, ignore_eos=request.ignore_eos,
                stop_token_ids=[int(t) for t in request.stop_token_ids], stop_words=list(request.stop))
        except ConfigError as e:
            raise GatewayError(400, f"sampling.{e}", param="sampling") from None


def _usage(prompt_tokens: int, completion_tokens: int, ttft_s: float, latency_s: float) -> generate_pb2.Usage:
    return generate_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                              time_to_first_token_us=int(ttft_s * 1e6), latency_us=int(latency_s * 1e6))


def _spec_stats_pb(stats: SpecStats | None) -> common_pb2.SpecStats:
    stats = stats or SpecStats()
    return common_pb2.SpecStats(num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
                                num_accepted_tokens=stats.num_accepted_tokens,
                                accepted_per_position=list(stats.accepted_per_position))


async def build_grpc_server(gateway: Gateway, host: str, port: int) -> tuple[grpc.aio.Server, int, object]:
    """A started grpc.aio server with Generate, health checking and reflection; returns (server, port, health).

    Messages over the gateway's max_request_bytes are refused by grpc itself (RESOURCE_EXHAUSTED).
    """
    config = gateway.config
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(gateway.api_keys), ErrorInterceptor()],
                             options=[("grpc.max_receive_message_length", config.max_request_bytes),
                                      NO_PORT_SHARING])
    generate_pb2_grpc.add_GenerateServicer_to_server(GenerateServicer(gateway), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = add_port(server, f"{host}:{port}", config.tls)
    if bound == 0:
        raise OSError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer
