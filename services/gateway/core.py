"""The gateway core: validate, tokenize, enqueue, read results (protocol-neutral).

`Gateway` is what the OpenAI HTTP routes (app.py) and the gRPC servicer (grpc_api.py) both call. A
request is answered (or its stream started) only after its XADD to the request stream succeeded;
errors of every kind are raised as GatewayError, which each protocol maps in one place. Bad input
is refused before anything is queued: unparsable or out-of-range fields (400, naming the field),
unknown models (404), prompts past the context.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import redis.exceptions

from specd.messages import ConfigError
from specd.models.loader import load_tokenizer
from specd.models.model_path import resolve_model_path
from specd.transport.redis_streams import CONSUMER_GROUP, DEFAULT_REQUEST_STREAM, RESULT_PREFIX, QueuedRequest

from services.common.api_keys import ApiKeys
from services.common.tls import PLAINTEXT, TLSConfig, channel_credentials
from services.gateway.metrics import GatewayMetrics
from services.gateway.redis_client import gateway_redis
from services.gateway.errors import REDIS_ERRORS, GatewayError, redis_unavailable
from services.gateway.idempotency import IdempotencyKeys, queued_field, record_key
from services.gateway.request_stream import GenerationOutput, RequestStream, RequestTimings
from services.gateway.result_reader import ResultReader
from services.gateway.reasoning import reasoning_format
from services.gateway.tool_formats import ToolCallFormat, tool_call_format
from services.gateway.tools import ToolRequest
from services.gateway.validation import find_invalid_value

logger = logging.getLogger(__name__)

# XADD only while XLEN < limit (limit 0: no limit), atomically; returns the entry id or the depth.
# With an idempotency record (KEYS[2], ARGV[2] the request's field in it: idempotency.py) only once
# per request, whichever call comes first: "queued" when one did.
_XADD_IF_ROOM = """
if KEYS[2] and redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then return 'queued' end
local depth = redis.call('XLEN', KEYS[1])
local limit = tonumber(ARGV[1])
if limit > 0 and depth >= limit then return depth end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
if KEYS[2] then redis.call('HSET', KEYS[2], ARGV[2], id) end
return id
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
    tool_call_parser: str = ""  # how the model writes tool calls (tool_formats.py); "": from the template
    reasoning_parser: str = ""  # deepseek_r1 | qwen3: reasoning_content split off (reasoning.py); "": none
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # HTTP bodies (413) and gRPC messages
    api_keys: tuple[str, ...] = ()  # accepted Bearer keys; empty: no key needed
    tls: TLSConfig = PLAINTEXT  # the gRPC server's certificate; the CA the grammar service is checked with
    ssl: bool = False  # HTTPS on the OpenAI port too, with tls's certificate (lmdeploy's --ssl)

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
        if self.ssl and not self.tls.serves_tls:
            raise ConfigError("ssl: HTTPS needs the certificate of --tls-cert-file and --tls-key-file")

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
        self.client = client or gateway_redis(config.redis_url)
        self.reader = ResultReader(self.client, prefix=config.result_prefix)
        self.metrics = GatewayMetrics(self.model_name)
        self._xadd_if_room = self.client.register_script(_XADD_IF_ROOM)
        self.idempotency = IdempotencyKeys(self.client)
        self.api_keys = ApiKeys(config.api_keys)
        # One thread: long prompts tokenize off the event loop (other requests' streams keep
        # flowing), and HF tokenizers are not safe to call from several threads at once.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="specd-tokenize")
        self.created = int(time.time())
        self._tool_call_format = tool_call_format(config.tool_call_parser, self.tokenizer.chat_template)
        self.reasoning = reasoning_format(config.reasoning_parser)

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

    def check_token_ids(self, params) -> None:
        """The token ids a request's parameters name (stop_token_ids, logit_bias) in the vocabulary."""
        for name, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            if any(not 0 <= t < self.vocab_size for t in token_ids):
                raise GatewayError(400, f"{name}: token ids must be in [0, {self.vocab_size})", param=name)

    async def _tokenize(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, lambda: fn(*args, **kwargs))

    async def encode_text(self, text: str) -> list[int]:
        return await self._tokenize(self.tokenizer.encode, text, add_special_tokens=True)

    def tool_call_format(self, tools: ToolRequest | None) -> ToolCallFormat | None:
        """How this model's calls are written and read, for a request whose calls are parsed (None
        for requests without tools or with tool_choice 'none'); 400 when the model has none."""
        if tools is None or not tools.parses_calls:
            return None
        if self._tool_call_format is None:
            raise GatewayError(400, "tools: this model's chat template writes no tool calls in a known format; "
                                    "start the gateway with --tool-call-parser", param="tools")
        return self._tool_call_format

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
        return await self._tokenize(self._encode_chat, messages, add_generation_prompt, template_kwargs, tools)

    def _encode_chat(self, messages: list[dict], add_generation_prompt: bool,
                     template_kwargs: dict | None, tools: list[dict] | None = None) -> list[int]:
        if not self.tokenizer.chat_template:
            raise GatewayError(400, "this model has no chat template; use /v1/completions", param="messages")
        kwargs = {k: v for k, v in (template_kwargs or {}).items()
                  if k not in ("conversation", "messages", "tokenize", "add_generation_prompt", "tools")}
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools or None,
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

    async def check_response_format(self, response_format: dict | None, param: str = "response_format") -> None:
        """400 for a malformed response_format or a grammar that does not compile, before queueing
        (param: the field the error names: the tools, where their calls are the constraint)."""
        from specd.grammar.errors import GrammarCompileError
        from specd.grammar.response_format import parse_response_format

        try:
            spec = parse_response_format(response_format)
            if spec is not None:
                await asyncio.to_thread(self._grammar_validator().validate, spec)
        except (ConfigError, GrammarCompileError) as e:
            message = str(e) if param == "response_format" else f"{param}: {str(e).split(': ', 1)[-1]}"
            raise GatewayError(400, message, param=param) from None

    def _grammar_validator(self):
        """The grammar service's Validate RPC, or a local compile cache (made on first use)."""
        if getattr(self, "_validator", None) is None:
            if self.config.grammar:
                from specd.clients.grammar import RemoteGrammarBackend

                self._validator = RemoteGrammarBackend(self.config.grammar,
                                                       credentials=channel_credentials(self.config.tls))
            else:
                from specd.grammar.compiler import GrammarCompilerCache

                self._validator = GrammarCompilerCache.from_model_dir(self.config.model)
        return self._validator

    # ---- the queue ----------------------------------------------------------------------------
    async def submit(self, queued: QueuedRequest, timings: RequestTimings, timeout_s: float | None = None,
                     constraint_param: str = "response_format", idempotency_key: str | None = None
                     ) -> RequestStream:
        """XADD to the request stream (429 when full, 503 when Redis is down) and open its result stream.

        timeout_s: this request's deadline from receipt (default and upper bound: request_timeout).
        """
        timeout_s = min(timeout_s or self.config.request_timeout, self.config.request_timeout)
        self.check_token_ids(queued.params)
        await self.check_response_format(queued.response_format, constraint_param)
        rid = queued.request_id
        keep = idempotency_key is not None
        queue = self.reader.subscribe(rid, keep=keep)
        fields = [x for kv in queued.to_fields().items() for x in kv]
        keys, once = [self.config.request_stream], ""
        if keep:  # queued once per key, whichever call comes first (a retry may be the one)
            keys, once = [*keys, record_key(idempotency_key)], queued_field(rid)
        try:
            reply = await self._xadd_if_room(keys=keys, args=[self.config.max_queue_depth, once, *fields])
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
        if reply in (b"queued", "queued"):
            logger.info("request %s attached: an earlier call with its Idempotency-Key queued it", rid)
        return self._stream(queued, queue, timings, timeout_s, keep)

    def _stream(self, queued: QueuedRequest, queue, timings: RequestTimings, timeout_s: float,
                keep: bool) -> RequestStream:
        # A keyed request outlives its client: leaving stops the reading only (a retry reads on).
        on_abandon = self.detach if keep else self.abandon
        return RequestStream(queued.request_id, queue, self.tokenizer, queued.params,
                             num_prompt_tokens=len(queued.prompt_token_ids),
                             deadline=timings.received + timeout_s, timings=timings,
                             on_finish=self._finished, on_abandon=on_abandon)

    def detach(self, request_id: str, reason: str) -> None:
        """Stop reading a keyed request's results; it runs on for a retry to read."""
        logger.info("request %s detached: %s", request_id, reason)
        self.reader.unsubscribe(request_id, delete=False)

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
