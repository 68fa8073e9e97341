"""The gateway's OpenAI-compatible HTTP API (FastAPI) over the protocol-neutral core (core.py).

Bad input is refused before anything is queued: oversized bodies (413), missing API keys (401),
unparsable or out-of-range fields (400, naming the field), unknown models (404); every error is
mapped to one JSON shape in one place (_install_error_handlers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import redis.exceptions
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.api_keys import INVALID_KEY_MESSAGE
from services.gateway import openai_api as oai
from services.gateway.body_limit import BodySizeLimit
from services.gateway.core import Gateway, collect, first_output
from services.gateway.errors import GatewayError, redis_unavailable
from services.gateway.idempotency import HEADER as IDEMPOTENCY_HEADER, check_key, fingerprint
from services.gateway.logprobs import LogprobRenderer
from services.gateway.metrics import CONTENT_TYPE_LATEST
from services.gateway.request_stream import GenerationOutput, RequestStream, RequestTimings
from services.gateway.reasoning import ReasoningStream
from services.gateway.tools import ToolCallStream, call_id, template_messages, tool_call_dict
from specd.messages import ConfigError, SpecStats

logger = logging.getLogger(__name__)

KEY_HEADER = Header(None, alias=IDEMPOTENCY_HEADER)  # idempotency.py
LAST_EVENT_HEADER = Header(None, alias="Last-Event-ID")  # SSE's: resume a keyed stream after that event


def create_app(gateway: Gateway) -> FastAPI:
    """The OpenAI-compatible HTTP API over a Gateway."""
    app = FastAPI(title="specd gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    _install_error_handlers(app, gateway)

    async def reject_too_large(scope, receive, send) -> None:
        await _error_response(gateway, _too_large(gateway))(scope, receive, send)

    app.add_middleware(BodySizeLimit, max_bytes=gateway.config.max_request_bytes, reject=reject_too_large)
    name = gateway.model_name
    bearer = HTTPBearer(auto_error=False)  # None without `Authorization: Bearer ...`; we answer 401

    async def require_api_key(auth: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not gateway.api_keys.is_valid(auth.credentials if auth is not None else None):
            raise GatewayError(401, INVALID_KEY_MESSAGE, code="invalid_api_key")

    keyed = [Depends(require_api_key)]  # every route but /health and /metrics, as lmdeploy

    def model_card() -> oai.ModelCard:
        return oai.ModelCard(id=name, created=gateway.created, max_model_len=gateway.max_model_len)

    @app.get("/health")
    async def health() -> dict:
        await gateway.health()
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> oai.ModelList:
        return oai.ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", dependencies=keyed)
    async def model(model_id: str) -> oai.ModelCard:
        gateway.check_model(model_id)
        return model_card()

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(body: oai.ChatCompletionRequest, idempotency_key: str | None = KEY_HEADER,
                               last_event_id: str | None = LAST_EVENT_HEADER):
        timings = RequestTimings()
        gateway.check_model(body.model)
        gateway.check_values(body.model_dump(exclude_unset=True))
        tools = body.tool_request()
        call_format = gateway.tool_call_format(tools)
        messages = template_messages([m.to_template_dict() for m in body.messages])
        prompt = await gateway.encode_chat(messages, body.add_generation_prompt, body.chat_template_kwargs,
                                           tools=tools and tools.template_tools)
        constraint = oai.response_format_of(body)
        if call_format is not None:
            if constraint is not None:
                raise GatewayError(400, "response_format: cannot be combined with tool calls (tool_choice "
                                        "'none' allows it)", param="response_format")
            constraint = tools.response_format(call_format)
        reasoning = gateway.reasoning
        if reasoning is not None and constraint is not None:  # the answer is constrained, not the thinking
            try:
                constraint = reasoning.constrain_after(constraint)
            except ConfigError as e:
                raise GatewayError(400, str(e), param="response_format") from None
        streams, meta = await _submit(gateway, body, prompt, timings, "chatcmpl-", constraint,
                                      constraint_param="tools" if call_format else "response_format",
                                      idempotency_key=idempotency_key)
        if body.stream:
            resume = _resume_position(last_event_id, len(streams))
            return await _sse_response(gateway, streams, meta, body.include_usage, oai.ChatCompletionChunk,
                                       [oai.chat_chunks(s, meta, body.include_usage, i, usage_chunk=len(streams) == 1,
                                                        tool_calls=call_format and ToolCallStream(call_format,
                                                                                                  s.request_id),
                                                        reasoning=reasoning and ReasoningStream(reasoning),
                                                        event_ids=len(streams) == 1, resume_after=resume)
                                        for i, s in enumerate(streams)])
        results = await _collect_all(streams)
        choices = []
        for i, (stream, result) in enumerate(zip(streams, results)):
            logprobs = LogprobRenderer.of(stream)
            thinking, text = reasoning.split(result.text, final=True) if reasoning else ("", result.text)
            message = oai.ChatResponseMessage(content=text, reasoning_content=thinking or None)
            finish_reason = result.finish_reason
            if call_format is not None:
                split = call_format.split(text, final=True)
                calls = [tool_call_dict(call, call_id(stream.request_id, j)) for j, call in enumerate(split.calls)]
                message = oai.ChatResponseMessage(content=split.content or (None if calls else ""),
                                                  reasoning_content=thinking or None, tool_calls=calls or None)
                finish_reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
            choices.append(oai.ChatChoice(index=i, message=message,
                                          logprobs=logprobs and logprobs.chat(result.logprobs),
                                          finish_reason=finish_reason))
        return oai.ChatCompletionResponse(**meta, choices=choices, usage=_usage(results),
                                          spec_stats=oai.SpecStatsInfo.of(_spec_stats(results)))

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: oai.CompletionRequest, idempotency_key: str | None = KEY_HEADER,
                          last_event_id: str | None = LAST_EVENT_HEADER):
        timings = RequestTimings()
        gateway.check_model(body.model)
        gateway.check_values(body.model_dump(exclude_unset=True))
        prompt = await gateway.encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        streams, meta = await _submit(gateway, body, prompt, timings, "cmpl-", idempotency_key=idempotency_key)
        if body.stream:
            resume = _resume_position(last_event_id, len(streams))
            return await _sse_response(gateway, streams, meta, body.include_usage, oai.CompletionChunk,
                                       [oai.completion_chunks(s, meta, body.include_usage, i,
                                                              usage_chunk=len(streams) == 1,
                                                              event_ids=len(streams) == 1, resume_after=resume)
                                        for i, s in enumerate(streams)])
        results = await _collect_all(streams)
        choices = []
        for i, (stream, result) in enumerate(zip(streams, results)):
            logprobs = LogprobRenderer.of(stream)
            choices.append(oai.CompletionChoice(index=i, text=result.text, finish_reason=result.finish_reason,
                                                logprobs=logprobs and logprobs.completion(result.logprobs)))
        return oai.CompletionResponse(**meta, choices=choices, usage=_usage(results),
                                      spec_stats=oai.SpecStatsInfo.of(_spec_stats(results)))

    if gateway.config.enable_metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            await gateway.refresh_queue_metrics()
            return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _submit(gateway: Gateway, body, prompt: list[int], timings: RequestTimings, id_prefix: str,
                  constraint: dict | None = None, constraint_param: str = "response_format",
                  idempotency_key: str | None = None) -> tuple[list[RequestStream], dict]:
    """Queue the request's n choices (each a request of its own, seeded oai.choice_seed); a refusal
    of any (429, 503) abandons those queued before it. constraint: the output's (default: the
    request's response_format); constraint_param: the field its errors name. idempotency_key: a
    retry of a call with this key reads the requests that call queued (idempotency.py)."""
    max_tokens = gateway.check_prompt(prompt, body.requested_max_tokens)
    request_ids, created = [gateway.new_request_id() for _ in range(body.n)], int(time.time())
    earlier = None
    if idempotency_key is not None:
        # Streamed or not, the same request: a client may retry a dropped stream as a plain call.
        request_print = fingerprint(id_prefix, body.model_dump(exclude_unset=True,
                                                                exclude={"stream", "stream_options"}))
        earlier = await gateway.idempotency.claim(check_key(idempotency_key), request_print, request_ids, created)
        if earlier is not None:
            request_ids, created = earlier.request_ids, earlier.created
    streams: list[RequestStream] = []
    try:
        for index, request_id in enumerate(request_ids):
            queued = oai.to_queued_request(body, request_id, prompt, max_tokens, model=gateway.model_name,
                                           timeout_s=gateway.config.request_timeout, index=index,
                                           response_format=constraint)
            streams.append(await gateway.submit(queued, timings if index == 0 else RequestTimings(),
                                                constraint_param=constraint_param, idempotency_key=idempotency_key))
    except BaseException:
        for stream in streams:  # cancelled where this call queued them; an earlier call's run on
            if earlier is None:
                gateway.abandon(stream.request_id, "another choice of the request was refused")
            else:
                stream.abandon("another choice of the request failed")
        if idempotency_key is not None and earlier is None:
            await gateway.idempotency.release(idempotency_key)
        raise
    return streams, {"id": id_prefix + request_ids[0], "created": created, "model": gateway.model_name}


def _resume_position(last_event_id: str | None, num_choices: int) -> int | None:
    """The output tokens a resumed stream's client already has (SSE Last-Event-ID: a single
    choice's events are numbered by the tokens sent with them), None for the whole stream."""
    if last_event_id is None or num_choices != 1:
        return None
    if not last_event_id.isdigit():
        raise GatewayError(400, "Last-Event-ID: expected the id of one of this stream's events", param="Last-Event-ID")
    return int(last_event_id)


async def _collect_all(streams: list[RequestStream]) -> list:
    try:
        return list(await asyncio.gather(*(collect(s) for s in streams)))
    finally:
        for stream in streams:
            stream.abandon("cancelled while generating")


def _usage(results: list) -> oai.Usage:
    # The choices share one prompt: what one of them found cached (the others may wait for it).
    return oai.Usage.of(results[0].num_prompt_tokens, sum(len(r.token_ids) for r in results),
                        max(r.num_cached_tokens for r in results))


def _spec_stats(results: list) -> SpecStats:
    total = SpecStats()
    for r in results:
        total.merge(r.spec_stats)
    return total


async def _sse_response(gateway: Gateway, streams: list[RequestStream], meta: dict, include_usage: bool,
                        chunk_type, renders: list[Callable[[GenerationOutput | None], AsyncIterator[str]]]
                        ) -> StreamingResponse:
    """The choices' events as they come (each carries its choice's index), then, with n > 1 and
    include_usage, one usage chunk for them all."""
    firsts = []
    try:
        for stream in streams:
            firsts.append(await first_output(stream))
    except BaseException:
        for stream in streams:
            stream.abandon("cancelled before the first output")
        raise

    async def body() -> AsyncIterator[str]:
        try:
            async for event in merge_streams([render(first) for render, first in zip(renders, firsts)]):
                yield event
            if include_usage and len(streams) > 1:
                total = SpecStats()
                for stream in streams:
                    total.merge(stream.spec_stats)
                usage = oai.Usage.of(streams[0].num_prompt_tokens, sum(len(s.token_ids) for s in streams),
                                     max(s.num_cached_tokens for s in streams))
                yield oai.sse(chunk_type(**meta, choices=[], usage=usage, spec_stats=oai.SpecStatsInfo.of(total)),
                              include_usage=True)
        except GatewayError as e:  # after the headers went out: an in-band error event
            gateway.metrics.observe_error(e.status)
            yield oai.sse_error(e)
        finally:
            for stream in streams:
                stream.abandon("client disconnected")  # a no-op when the request finished
        yield oai.SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                      "X-Request-Id": streams[0].request_id})


async def merge_streams(sources: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The items of several async iterators as each comes; an error in one is raised here."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(source: AsyncIterator[str]) -> None:
        try:
            async for item in source:
                await queue.put(item)
            await queue.put(done)
        except BaseException as e:  # handed to the consumer, which raises it
            await queue.put(e)

    tasks = [asyncio.create_task(pump(s)) for s in sources]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


# ---- errors, in one place ----------------------------------------------------------------------------
def _error_response(gateway: Gateway, error: GatewayError) -> JSONResponse:
    gateway.metrics.observe_error(error.status)
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return JSONResponse(error.to_body(), status_code=error.status, headers=headers)


def _too_large(gateway: Gateway) -> GatewayError:
    return GatewayError(413, f"the request body is larger than this gateway accepts "
                             f"({gateway.config.max_request_bytes} bytes, --max-request-bytes)",
                        code="request_too_large")


def _validation_error(exc: RequestValidationError) -> GatewayError:
    messages, params = [], []
    for err in exc.errors()[:4]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            messages.append(f"the request body is not valid JSON ({msg})")
            continue
        if not loc and err.get("type") in ("model_attributes_type", "dict_type", "missing"):
            messages.append("the request body must be a JSON object, sent with Content-Type: application/json")
            continue
        where = ".".join(loc)
        params.append(where)
        messages.append(f"{where}: {msg}" if where else msg)
    return GatewayError(400, "; ".join(messages) or "invalid request", param=params[0] if params else None)


def _install_error_handlers(app: FastAPI, gateway: Gateway) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return _error_response(gateway, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(gateway, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 413:
            return _error_response(gateway, _too_large(gateway))
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = "the request body could not be parsed: send JSON encoded as UTF-8"
        return _error_response(gateway, GatewayError(exc.status_code, message))

    for redis_error in (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        @app.exception_handler(redis_error)
        async def redis_down(request: Request, exc: Exception) -> JSONResponse:
            return _error_response(gateway, redis_unavailable(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_response(gateway, GatewayError(500, f"internal error: {type(exc).__name__}"))
