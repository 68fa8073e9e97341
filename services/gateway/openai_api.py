"""The OpenAI API subset the gateway serves: request/response models and conversion to QueuedRequest.

Semantics follow OpenAI: temperature defaults to 1.0 and 0 is greedy; max_tokens defaults to 16
for completions and to the rest of the context for chat; `n` choices are n requests; presence_penalty,
frequency_penalty and logit_bias are served (docs/serving.md, "Sampling parameters"). Like vLLM and lmdeploy,
top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos, skip_special_tokens and
include_stop_str_in_output are accepted as extra fields. Log probabilities: chat's `logprobs` +
`top_logprobs` (0..20), completions' `logprobs` (0..5), and `logprobs_mode` ("raw" | "processed",
a specd/vLLM extension; docs/serving.md, "Log probabilities"). Tools: `tools`, `tool_choice`,
`parallel_tool_calls`, `functions`, `function_call` (tools.py). Responses carry specd's per-request
speculation figures as an extra top-level field `spec_stats`.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from specd.messages import ConfigError, SpecStats
from specd.sampling_params import SamplingParams
from specd.transport.redis_streams import QueuedRequest

from services.gateway.errors import GatewayError
from services.gateway.guided import GUIDED_FIELDS, constraint_of
from services.gateway.logprobs import ChatLogprobs, CompletionLogprobs, LogprobRenderer
from services.gateway.request_stream import GenerationOutput, RequestStream
from services.gateway.reasoning import ReasoningStream
from services.gateway.tools import ToolCallStream, ToolRequest, parse_tools
from services.gateway.validation import MAX_STOP_WORDS


# ---- requests ---------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


MAX_CHOICES = 16  # n: each choice is a request of its own in the queue


class _SamplingFields(BaseModel):
    """Fields chat and completion requests share."""

    # NaN and Infinity parse from JSON (Python's json accepts them) but are no sampling parameter.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices: n requests of the same prompt (choice_seed)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_WORDS)] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI sends it) -> [-100, 100]
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # extra fields (vLLM, lmdeploy)
    top_k: int = Field(0, ge=-1)  # 0 or -1 disables
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_WORDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's guided decoding (services/gateway/guided.py): served as the response_format they name
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # logprobs' distribution (vLLM's logprobs_mode): "raw" log_softmax of the model's logits, or
    # "processed": the distribution sampled from (after bias, penalties, temperature, filters)
    logprobs_mode: Literal["raw", "processed"] = "raw"

    @field_validator("response_format")
    @classmethod
    def _typed_format(cls, v: dict | None) -> dict | None:
        if v is not None and not isinstance(v.get("type"), str):
            raise ValueError("response_format needs a 'type' (text, json_object or json_schema)")
        return v

    @property
    def stop_words(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise GatewayError(400, "messages: only text content parts are supported",
                                       param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None  # services/gateway/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # OpenAI's legacy function calling
    function_call: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):  # as OpenAI
            raise ValueError("top_logprobs needs logprobs set to true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token, None where logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_request(self) -> ToolRequest | None:
        return parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls, self.functions,
                           self.function_call)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's legacy bound
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            v = v[0]
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("the prompt is empty")
        return v

    # Field validators, not one model validator: an error then names its field (param).
    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("best_of must be 1 (one sequence is generated per request)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# ---- conversion ----------------------------------------------------------------------------------
def to_sampling_params(req: _SamplingFields, max_tokens: int) -> SamplingParams:
    """OpenAI semantics to specd's SamplingParams (temperature 0 or top_p 0: greedy; no seed: draw one)."""
    greedy = req.temperature == 0.0 or req.top_p == 0.0
    seed = req.seed if req.seed is not None else random.getrandbits(62)
    try:
        return SamplingParams(
            temperature=0.0 if greedy else req.temperature,
            top_k=max(req.top_k, 0), top_p=1.0 if greedy else req.top_p, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, logit_bias=dict(req.logit_bias or {}),
            seed=seed % (2**63), max_new_tokens=max_tokens,
            min_new_tokens=min(req.min_tokens, max_tokens), ignore_eos=req.ignore_eos,
            stop_token_ids=list(req.stop_token_ids or []), stop_words=req.stop_words,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=req.num_logprobs,
            logprobs_mode=req.logprobs_mode)
    except ConfigError as e:
        raise GatewayError(400, str(e), param=str(e).split(":", 1)[0]) from None


def response_format_of(req: _SamplingFields) -> dict | None:
    """The structured-output constraint (response_format or a guided field), None for plain text."""
    return constraint_of(req.response_format, {name: getattr(req, name) for name in GUIDED_FIELDS})


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed of a request seeded `seed` (n > 1): choice 0 keeps it, so a request's
    first choice does not depend on n; the others are spread over the seed space (the noise of a
    position depends on (seed, position) only: specd/random.py), each an independent draw."""
    return (seed + index * 0x9E3779B97F4A7C15) % (2**63)


def to_queued_request(req: _SamplingFields, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                      *, model: str, timeout_s: float, index: int = 0,
                      response_format: dict | None = None) -> QueuedRequest:
    """Choice `index` of the request (choice_seed); response_format: the output's constraint
    (default: the request's own, response_format_of)."""
    now = time.time()
    params = to_sampling_params(req, max_tokens)
    params.seed = choice_seed(params.seed, index)
    return QueuedRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                         params=params, model=model, arrival_time=now,
                         deadline=now + timeout_s,
                         response_format=response_format if response_format is not None else response_format_of(req))


# ---- responses -------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # found in the verifier's prefix cache (docs/serving.md, "Prefix caching")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class SpecStatsInfo(BaseModel):
    """Per-request speculation figures (terms as in the README)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    acceptance_rate: float
    mean_acceptance_length: float
    num_zero_draft_steps: int = 0  # verify steps that checked no draft (adaptive k = 0 among them)
    mean_draft_length: float = 0.0  # drafts per verify step, k = 0 steps included

    @classmethod
    def of(cls, stats: SpecStats) -> "SpecStatsInfo":
        return cls(**stats.to_dict())


FinishReason = Literal["stop", "length", "tool_calls"]


class _Response(BaseModel):
    id: str
    created: int
    model: str


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser: the thinking before </think>
    tool_calls: list[dict[str, Any]] | None = None  # {id, type: "function", function: {name, arguments}}


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    spec_stats: SpecStatsInfo


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {index, id, type, function: {name, arguments}} deltas


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    spec_stats: SpecStatsInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    spec_stats: SpecStatsInfo


class CompletionChunk(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec_stats: SpecStatsInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specd"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse(chunk: ChatCompletionChunk | CompletionChunk, *, include_usage: bool = False,
        event_id: int | None = None) -> str:
    """One server-sent event; `usage` appears (null until the end) only with include_usage;
    event_id: its `id:` field (the output tokens sent so far, for Last-Event-ID)."""
    exclude = set() if include_usage else {"usage"}
    if chunk.spec_stats is None:
        exclude.add("spec_stats")
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def sse_error(error: GatewayError) -> str:
    """An error after the stream started (OpenAI clients raise APIError on it)."""
    return f"data: {json.dumps(error.to_body())}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def _outputs(stream: RequestStream, first: GenerationOutput | None) -> AsyncIterator[GenerationOutput]:
    if first is not None:
        yield first
    async for out in stream:
        yield out


def chat_chunks(stream: RequestStream, meta: dict, include_usage: bool, index: int = 0, usage_chunk: bool = True,
                tool_calls: ToolCallStream | None = None, reasoning: ReasoningStream | None = None,
                event_ids: bool = False, resume_after: int | None = None):
    """Renders a chat stream (choice `index`) as SSE chunks: the role, text deltas (with reasoning:
    reasoning_content first; with tool_calls: content and tool-call deltas), finish_reason +
    spec_stats, usage (usage_chunk False: the caller sends the usage of every choice at once).
    event_ids: each delta's `id:` is the output tokens sent so far; resume_after: the client has
    the events up to that id (Last-Event-ID), which are rendered but not sent."""
    logprobs = LogprobRenderer.of(stream)

    def delta_of(out: GenerationOutput) -> tuple[ChatDelta, str | None]:
        final = out.finish_reason is not None
        thinking, text = reasoning.feed(out.text or "", final) if reasoning is not None else ("", out.text or "")
        if tool_calls is None:
            return ChatDelta(content=text or None, reasoning_content=thinking or None), out.finish_reason
        content, calls = tool_calls.feed(text, final)
        finish = "tool_calls" if out.finish_reason == "stop" and tool_calls.num_calls else out.finish_reason
        return ChatDelta(content=content or None, reasoning_content=thinking or None,
                         tool_calls=calls or None), finish

    async def render(first: GenerationOutput | None) -> AsyncIterator[str]:
        if resume_after is None:
            yield sse(ChatCompletionChunk(**meta, choices=[ChatChunkChoice(
                index=index, delta=ChatDelta(role="assistant", content=""))]), include_usage=include_usage,
                event_id=0 if event_ids else None)
        async for out in _outputs(stream, first):
            delta, finish_reason = delta_of(out)
            sent = len(stream.token_ids)
            if resume_after is not None and sent <= resume_after:
                continue
            if delta.content or delta.reasoning_content or delta.tool_calls or finish_reason or out.logprobs:
                yield sse(ChatCompletionChunk(
                    **meta, choices=[ChatChunkChoice(index=index, delta=delta,
                                                     logprobs=logprobs and logprobs.chat(out.logprobs),
                                                     finish_reason=finish_reason)],
                    spec_stats=SpecStatsInfo.of(out.spec_stats) if out.finish_reason else None),
                    include_usage=include_usage, event_id=sent if event_ids else None)
        if include_usage and usage_chunk:  # the request's speculation figures again, beside its usage
            yield sse(ChatCompletionChunk(**meta, choices=[], usage=Usage.of(
                stream.num_prompt_tokens, len(stream.token_ids), stream.num_cached_tokens),
                spec_stats=SpecStatsInfo.of(stream.spec_stats)),
                include_usage=True)
    return render


def completion_chunks(stream: RequestStream, meta: dict, include_usage: bool, index: int = 0,
                      usage_chunk: bool = True, event_ids: bool = False, resume_after: int | None = None):
    """Renders a completion stream (choice `index`) as SSE chunks: text deltas, finish_reason +
    spec_stats, usage (usage_chunk, event_ids and resume_after as chat_chunks')."""
    logprobs = LogprobRenderer.of(stream)

    async def render(first: GenerationOutput | None) -> AsyncIterator[str]:
        async for out in _outputs(stream, first):
            sent = len(stream.token_ids)
            if resume_after is not None and sent <= resume_after:
                continue
            if out.text or out.finish_reason or out.logprobs:
                yield sse(CompletionChunk(
                    **meta, choices=[CompletionChoice(index=index, text=out.text, finish_reason=out.finish_reason,
                                                      logprobs=logprobs and logprobs.completion(out.logprobs))],
                    spec_stats=SpecStatsInfo.of(out.spec_stats) if out.finish_reason else None),
                    include_usage=include_usage, event_id=sent if event_ids else None)
        if include_usage and usage_chunk:  # the request's speculation figures again, beside its usage
            yield sse(CompletionChunk(**meta, choices=[], usage=Usage.of(
                stream.num_prompt_tokens, len(stream.token_ids), stream.num_cached_tokens),
                spec_stats=SpecStatsInfo.of(stream.spec_stats)),
                include_usage=True)
    return render
