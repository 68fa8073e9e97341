"""The gateway core (validate, tokenize, enqueue, read results) and its FastAPI app.

`Gateway` is protocol-neutral: the OpenAI HTTP routes here and the gRPC servicer (grpc_api.py)
both call it. A request is answered (or its stream started) only after its XADD to the request
stream succeeded; errors of every kind are raised as GatewayError and mapped in one place.
Bad input is refused before anything is queued: oversized bodies (413), missing API keys (401),
unparsable or out-of-range fields (400, naming the field), unknown models (404).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio
import redis.exceptions
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from starlette.exceptions import HTTPException as StarletteHTTPException

from specd.messages import ConfigError
from specd.models.loader import load_tokenizer
from specd.models.model_path import resolve_model_path
from specd.transport.redis_streams import (CONSUMER_GROUP, DEFAULT_REQUEST_STREAM, RESULT_PREFIX,
                                           QueuedRequest)

from services.common.api_keys import INVALID_KEY_MESSAGE, ApiKeys
from services.common.tls import PLAINTEXT, TLSConfig, channel_credentials
from services.gateway import openai_api as oai
from services.gateway.body_limit import BodySizeLimit
from services.gateway.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from services.gateway.errors import REDIS_ERRORS, GatewayError, redis_unavailable
from services.gateway.request_stream import GenerationOutput, RequestStream, RequestTimings
from services.gateway.result_reader import ResultReader
from services.gateway.validation import find_invalid_value

logger = logging.getLogger(__name__)

# XADD only while XLEN < limit (limit 0: no limit), atomically; returns the entry id or the depth.
_XADD_IF_ROOM = """
local depth = redis.call('XLEN', KEYS[1])
local limit = tonumber(ARGV[1])
if limit > 0 and depth >= limit then return depth end
return redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
"""

# A body this size holds a 1M-token prompt as token ids; raise it for longer contexts.
DEFAULT_MAX_REQUEST_BYTES = 16 << 20


@dataclass
class GatewayConfig:
    """What `specd gateway` is started with."""

    model: str  # checkpoint directory or cached Hub id (tokenizer and config.json only)
    served_model_name: str = ""  # "" serves the model under the `model` argument as given
    redis_url: str = "redis://127.0.0.1:6379/0"
    request_stream: str = DEFAULT_REQUEST_STREAM
    result_prefix: str = RESULT_PREFIX
    max_queue_depth: int = 1024  # 429 when the request stream holds this many; 0: no limit
    request_timeout: float = 600.0  # seconds from receipt to the final token; then 504
    enable_metrics: bool = False
    max_model_len: int | None = None  # None: config.json's max_position_embeddings
    grammar: str = ""  # grammar service host:port validating response_format; "": compile here
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # HTTP bodies (413) and gRPC messages
    api_keys: tuple[str, ...] = ()  # accepted Bearer keys; empty: no key needed
    tls: TLSConfig = PLAINTEXT  # the gRPC server's certificate; the CA the grammar service is checked with

    def __post_init__(self) -> None:
        if self.max_queue_depth < 0:
            raise ConfigError(f"max_queue_depth: must be >= 0, got {self.max_queue_depth}")
        if self.request_timeout <= 0:
            raise ConfigError(f"request_timeout: must be > 0, got {self.request_timeout}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"max_request_bytes: must be >= 1024, got {self.max_request_bytes}")
        self.api_keys = tuple(self.api_keys)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class Gateway:
    """Validation, tokenization, the request queue and the result reader of one gateway process."""

    def __init__(self, config: GatewayConfig, *, tokenizer=None, client=None) -> None:
        self.config = config
        self.model_name = config.model_name
        model_dir = resolve_model_path(config.model)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        hf = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        text_config = hf.get("text_config") or hf
        self.max_model_len = int(config.max_model_len or text_config.get("max_position_embeddings")
                                 or hf.get("max_position_embeddings") or 4096)
        self.vocab_size = int(text_config.get("vocab_size") or len(self.tokenizer))
        # Fail fast when Redis is down: one short retry, then 503 (never a hang).
        self.client = client or redis.asyncio.Redis.from_url(
            config.redis_url, socket_connect_timeout=1.0, socket_timeout=10.0,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 1))
        self.reader = ResultReader(self.client, prefix=config.result_prefix)
        self.metrics = GatewayMetrics(self.model_name)
        self._xadd_if_room = self.client.register_script(_XADD_IF_ROOM)
        self.api_keys = ApiKeys(config.api_keys)
        # One thread: long prompts tokenize off the event loop (other requests' streams keep
        # flowing), and HF tokenizers are not safe to call from several threads at once.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="specd-tokenize")
        self.created = int(time.time())

    async def start(self) -> None:
        self.reader.start()

    async def close(self) -> None:
        await self.reader.stop()
        await self.client.aclose()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ---- validation and tokenization ----------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name and name != self.model_name:
            raise GatewayError(404, f"The model `{name}` does not exist; this gateway serves "
                                    f"`{self.model_name}`.", param="model", code="model_not_found")

    def check_values(self, values: dict) -> None:
        """400 for text that is not valid Unicode (lone surrogates) or absurdly deep nesting."""
        problem = find_invalid_value(values)
        if problem is not None:
            path, message = problem
            raise GatewayError(400, f"{path}: {message}", param=path or None)

    def check_stop_token_ids(self, token_ids: list[int]) -> None:
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise GatewayError(400, f"stop_token_ids: token ids must be in [0, {self.vocab_size})",
                               param="stop_token_ids")

    async def _tokenize(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, lambda: fn(*args, **kwargs))

    async def encode_text(self, text: str) -> list[int]:
        return await self._tokenize(self.tokenizer.encode, text, add_special_tokens=True)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          template_kwargs: dict | None = None) -> list[int]:
        return await self._tokenize(self._encode_chat, messages, add_generation_prompt, template_kwargs)

    def _encode_chat(self, messages: list[dict], add_generation_prompt: bool,
                     template_kwargs: dict | None) -> list[int]:
        if not self.tokenizer.chat_template:
            raise GatewayError(400, "this model has no chat template; use /v1/completions", param="messages")
        kwargs = {k: v for k, v in (template_kwargs or {}).items()
                  if k not in ("conversation", "messages", "tokenize", "add_generation_prompt")}
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # jinja's TemplateError (raise_exception in templates), bad kwargs
            raise GatewayError(400, f"messages: the chat template failed: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_prompt(self, token_ids: list[int], max_tokens: int | None) -> int:
        """Validate the prompt against the vocabulary and context; returns max_tokens (None: the rest)."""
        n = len(token_ids)
        if n == 0:
            raise GatewayError(400, "the prompt is empty", param="prompt")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise GatewayError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        limit = self.max_model_len
        if n >= limit:
            raise GatewayError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                    f"prompt has {n} tokens.", param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            return limit - n
        if n + max_tokens > limit:
            raise GatewayError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                    f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} for "
                                    f"the completion). Reduce the prompt or max_tokens.",
                               param="max_tokens", code="context_length_exceeded")
        return max_tokens

    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

    async def check_response_format(self, response_format: dict | None) -> None:
        """400 for a malformed response_format or a grammar that does not compile, before queueing."""
        from specd.grammar.errors import GrammarCompileError
        from specd.grammar.response_format import parse_response_format

        try:
            spec = parse_response_format(response_format)
            if spec is not None:
                await asyncio.to_thread(self._grammar_validator().validate, spec)
        except (ConfigError, GrammarCompileError) as e:
            raise GatewayError(400, str(e), param="response_format") from None

    def _grammar_validator(self):
        """The grammar service's Validate RPC, or a local compile cache (made on first use)."""
        if getattr(self, "_validator", None) is None:
            if self.config.grammar:
                from specd.grammar.remote import RemoteGrammarBackend

                self._validator = RemoteGrammarBackend(self.config.grammar,
                                                       credentials=channel_credentials(self.config.tls))
            else:
                from specd.grammar.compiler import GrammarCompilerCache

                self._validator = GrammarCompilerCache.from_model_dir(self.config.model)
        return self._validator

    # ---- the queue ----------------------------------------------------------------------------
    async def submit(self, queued: QueuedRequest, timings: RequestTimings,
                     timeout_s: float | None = None) -> RequestStream:
        """XADD to the request stream (429 when full, 503 when Redis is down) and open its result stream.

        timeout_s: this request's deadline from receipt (default and upper bound: request_timeout).
        """
        timeout_s = min(timeout_s or self.config.request_timeout, self.config.request_timeout)
        self.check_stop_token_ids(queued.params.stop_token_ids)
        await self.check_response_format(queued.response_format)
        rid = queued.request_id
        queue = self.reader.subscribe(rid)
        fields = [x for kv in queued.to_fields().items() for x in kv]
        try:
            reply = await self._xadd_if_room(keys=[self.config.request_stream],
                                             args=[self.config.max_queue_depth, *fields])
        except REDIS_ERRORS as e:
            self.reader.unsubscribe(rid, delete=False)
            raise redis_unavailable(e) from None
        except BaseException:
            self.reader.unsubscribe(rid, delete=False)
            raise
        if isinstance(reply, int):
            self.reader.unsubscribe(rid, delete=False)
            raise GatewayError(429, f"the request queue is full ({reply} requests waiting, limit "
                                    f"{self.config.max_queue_depth}); retry later", code="queue_full",
                               retry_after=1)
        return RequestStream(rid, queue, self.tokenizer, queued.params,
                             num_prompt_tokens=len(queued.prompt_token_ids),
                             deadline=timings.received + timeout_s, timings=timings,
                             on_finish=self._finished, on_abandon=self.abandon)

    def _finished(self, stream: RequestStream) -> None:
        self.metrics.observe_finished(
            finish_reason=stream.finish_reason or "stop", spec_stats=stream.spec_stats,
            num_prompt_tokens=stream.num_prompt_tokens, num_output_tokens=len(stream.token_ids),
            time_to_first_token=stream.timings.time_to_first_token, latency=stream.timings.latency)

    def abandon(self, request_id: str, reason: str) -> None:
        """Stop reading a request's results (client gone, timeout) and cancel it: its verifier
        sees the cancel key within a step, aborts it and frees its KV blocks."""
        logger.info("request %s abandoned: %s", request_id, reason)
        self.reader.cancel(request_id)
        if reason != "timeout":  # timeouts are counted as 504 errors where they are answered
            self.metrics.observe_error(499)

    async def health(self) -> None:
        try:
            await asyncio.wait_for(self.client.ping(), 2.0)
        except (*REDIS_ERRORS, asyncio.TimeoutError) as e:
            raise redis_unavailable(e) from None

    async def refresh_queue_metrics(self) -> None:
        try:
            depth = await self.client.xlen(self.config.request_stream)
            try:
                pending = (await self.client.xpending(self.config.request_stream, CONSUMER_GROUP))["pending"]
            except redis.exceptions.ResponseError:  # no group (no verifier started yet) or no stream
                pending = 0
            self.metrics.set_queue(depth, pending)
        except REDIS_ERRORS as e:
            logger.warning("queue metrics not refreshed: %s", e)


async def first_output(stream: RequestStream) -> GenerationOutput | None:
    """Wait for the first output, so that errors before it still become an HTTP status / gRPC code."""
    try:
        return await anext(stream, None)
    except BaseException:
        stream.abandon("cancelled before the first output")
        raise


async def collect(stream: RequestStream):
    try:
        return await stream.collect()
    finally:
        stream.abandon("cancelled while generating")


# ---- HTTP -------------------------------------------------------------------------------------------
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
        return oai.ChatCompletionResponse(
            **meta, choices=[oai.ChatChoice(message=oai.ChatResponseMessage(content=result.text),
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
        return oai.CompletionResponse(
            **meta, choices=[oai.CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
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
