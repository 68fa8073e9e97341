"""The gateway's OpenAI-compatible HTTP API (FastAPI) over the protocol-neutral core (core.py).

Bad input is refused before anything is queued: oversized bodies (413), missing API keys (401),
unparsable or out-of-range fields (400, naming the field), unknown models (404); every error is
mapped to one JSON shape in one place (_install_error_handlers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

import redis.exceptions
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.api_keys import INVALID_KEY_MESSAGE
from services.gateway import openai_api as oai
from services.gateway.body_limit import BodySizeLimit
from services.gateway.core import Gateway, collect, first_output
from services.gateway.errors import GatewayError, redis_unavailable
from services.gateway.logprobs import LogprobRenderer
from services.gateway.metrics import CONTENT_TYPE_LATEST
from services.gateway.request_stream import GenerationOutput, RequestStream, RequestTimings

logger = logging.getLogger(__name__)


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
    async def chat_completions(body: oai.ChatCompletionRequest):
        timings = RequestTimings()
        gateway.check_model(body.model)
        gateway.check_values(body.model_dump(exclude_unset=True))
        prompt = await gateway.encode_chat([m.to_template_dict() for m in body.messages], body.add_generation_prompt,
                                     body.chat_template_kwargs)
        stream, meta = await _submit(gateway, body, prompt, timings, "chatcmpl-")
        if body.stream:
            return await _sse_response(gateway, stream, oai.chat_chunks(stream, meta, body.include_usage))
        result = await collect(stream)
        logprobs = LogprobRenderer.of(stream)
        return oai.ChatCompletionResponse(
            **meta, choices=[oai.ChatChoice(message=oai.ChatResponseMessage(content=result.text),
                                            logprobs=logprobs and logprobs.chat(result.logprobs),
                                            finish_reason=result.finish_reason)],
            usage=oai.Usage.of(result.num_prompt_tokens, len(result.token_ids)),
            spec_stats=oai.SpecStatsInfo.of(result.spec_stats))

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: oai.CompletionRequest):
        timings = RequestTimings()
        gateway.check_model(body.model)
        gateway.check_values(body.model_dump(exclude_unset=True))
        prompt = await gateway.encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        stream, meta = await _submit(gateway, body, prompt, timings, "cmpl-")
        if body.stream:
            return await _sse_response(gateway, stream, oai.completion_chunks(stream, meta, body.include_usage))
        result = await collect(stream)
        logprobs = LogprobRenderer.of(stream)
        return oai.CompletionResponse(
            **meta, choices=[oai.CompletionChoice(text=result.text, finish_reason=result.finish_reason,
                                                  logprobs=logprobs and logprobs.completion(result.logprobs))],
            usage=oai.Usage.of(result.num_prompt_tokens, len(result.token_ids)),
            spec_stats=oai.SpecStatsInfo.of(result.spec_stats))

    if gateway.config.enable_metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            await gateway.refresh_queue_metrics()
            return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _submit(gateway: Gateway, body, prompt: list[int], timings: RequestTimings,
                  id_prefix: str) -> tuple[RequestStream, dict]:
    max_tokens = gateway.check_prompt(prompt, body.requested_max_tokens)
    rid = gateway.new_request_id()
    queued = oai.to_queued_request(body, rid, prompt, max_tokens, model=gateway.model_name,
                                   timeout_s=gateway.config.request_timeout)
    stream = await gateway.submit(queued, timings)
    return stream, {"id": id_prefix + rid, "created": int(time.time()), "model": gateway.model_name}


async def _sse_response(gateway: Gateway, stream: RequestStream,
                        render: Callable[[GenerationOutput | None], AsyncIterator[str]]) -> StreamingResponse:
    first = await first_output(stream)

    async def body() -> AsyncIterator[str]:
        try:
            async for event in render(first):
                yield event
        except GatewayError as e:  # after the headers went out: an in-band error event
            gateway.metrics.observe_error(e.status)
            yield oai.sse_error(e)
        finally:
            stream.abandon("client disconnected")  # a no-op when the request finished
        yield oai.SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                      "X-Request-Id": stream.request_id})


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
