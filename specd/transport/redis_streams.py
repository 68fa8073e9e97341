"""The Redis Streams contract between gateways and verifiers: keys, entries, encodings.

Request stream (one per deployment, default `specd:requests`), consumer group `verifiers`:
    entry fields: id (request id), body (JSON of QueuedRequest)
    A verifier XREADGROUPs entries, XACKs and XDELs them when the request finished, so XLEN is the
    number of accepted requests not yet answered (the queue depth the gateway's backpressure uses;
    it works on Redis 6.2, which has no consumer-group lag).
Result stream (one per request, `specd:results:<id>`), written by the verifier, read by the gateway:
    kind=delta  pos=<output index of the first token>  tokens=<JSON list of token ids>
                spec_stats=<JSON SpecStats so far> (lets a verifier that resumes the request carry on
                counting where the dead one stopped)
                logprobs=<JSON list aligned with tokens: [logprob, [[token id, logprob], ...]] or null
                per token>, only for requests that asked (SamplingParams.logprobs)
    kind=final  pos, tokens (possibly empty), finish_reason, spec_stats (JSON), prompt_tokens, cached_tokens,
                logprobs
    kind=error  code (HTTP-like status), message
    A TTL makes abandoned results expire: set with a stream's first write and its last, and
    refreshed by any write a tenth of the TTL after the last refresh, so a stream outlives any
    write by at least 0.9 TTL (services/verifier/results/flush.py). Positions make deltas idempotent: a
    reader drops tokens below the position it already has (exactly-once across verifier restarts).
    The result stream is also the resume point: a verifier that reclaims the entry of a dead one
    replays it (specd/transport/resume.py) and continues from the tokens already written.
Cancel key (one per cancelled request, `specd:cancel:<id>`, with a TTL), set by the gateway when the
    client goes away; verifiers look up the keys of their running requests once per step.
Everything on the wire is JSON or integers: nothing is unpickled.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields as dataclass_fields
from typing import Any

from specd.messages import SpecStats
from specd.sampling_params import SamplingParams

DEFAULT_REQUEST_STREAM = "specd:requests"
CONSUMER_GROUP = "verifiers"
RESULT_PREFIX = "specd:results:"
RESULT_TTL_SECONDS = 600
CANCEL_PREFIX = "specd:cancel:"


def result_key(request_id: str, prefix: str = RESULT_PREFIX) -> str:
    return f"{prefix}{request_id}"


def cancel_key(request_id: str, prefix: str = CANCEL_PREFIX) -> str:
    return f"{prefix}{request_id}"


@dataclass
class QueuedRequest:
    """A validated, tokenized request as it waits in the request stream."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str = ""
    arrival_time: float = field(default_factory=time.time)
    deadline: float | None = None  # unix time after which the request is abandoned
    response_format: dict | None = None  # structured output (grammar service)

    def to_fields(self) -> dict[str, str]:
        body = {"prompt_token_ids": self.prompt_token_ids, "params": asdict(self.params), "model": self.model,
                "arrival_time": self.arrival_time, "deadline": self.deadline,
                "response_format": self.response_format}
        return {"id": self.request_id, "body": json.dumps(body, separators=(",", ":"))}

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> "QueuedRequest":
        f = {_s(k): _s(v) for k, v in fields.items()}
        body = json.loads(f["body"])
        return cls(request_id=f["id"], prompt_token_ids=[int(t) for t in body["prompt_token_ids"]],
                   params=SamplingParams(**body["params"]), model=body.get("model", ""),
                   arrival_time=float(body.get("arrival_time") or time.time()), deadline=body.get("deadline"),
                   response_format=body.get("response_format"))


@dataclass
class ResultEntry:
    """One entry of a result stream."""

    kind: str  # delta | final | error
    pos: int = 0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    spec_stats: SpecStats | None = None  # final: the request's; delta: so far (optional)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # final: prompt tokens the verifier found in its prefix cache
    code: int = 0
    message: str = ""
    # delta / final, for requests that asked: per token [logprob, [[token id, logprob], ...]] or None
    # (a resumed request's tokens emitted before); None where not asked
    logprobs: list | None = None

    def to_fields(self) -> dict[str, str]:
        fields: dict[str, Any] = {"kind": self.kind, "pos": self.pos, "tokens": json.dumps(self.tokens)}
        if self.logprobs is not None and self.kind in ("delta", "final"):
            fields["logprobs"] = json.dumps(self.logprobs)
        if self.kind == "delta" and self.spec_stats is not None:
            fields["spec_stats"] = json.dumps(asdict(self.spec_stats))
        if self.kind == "final":
            fields.update(finish_reason=self.finish_reason or "",
                          spec_stats=json.dumps(asdict(self.spec_stats or SpecStats())),
                          prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens)
        elif self.kind == "error":
            fields.update(code=self.code, message=self.message)
        return {k: str(v) for k, v in fields.items()}

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str], *, delta_stats: bool = True) -> "ResultEntry":
        """delta_stats=False leaves a delta's spec_stats unread (None): the gateway's reader, which
        uses the final's only, skips half of a delta's decoding (BENCHMARKS.md, "Result writes and
        reads (CPU)")."""
        f = {_s(k): _s(v) for k, v in fields.items()}
        entry = cls(kind=f["kind"], pos=int(f.get("pos", 0)), tokens=json.loads(f.get("tokens", "[]")))
        if "logprobs" in f:
            entry.logprobs = json.loads(f["logprobs"])
        if entry.kind == "delta" and delta_stats and "spec_stats" in f:
            entry.spec_stats = _spec_stats(f["spec_stats"])
        if entry.kind == "final":
            entry.finish_reason = f.get("finish_reason") or None
            entry.spec_stats = _spec_stats(f.get("spec_stats", "{}"))
            entry.prompt_tokens = int(f.get("prompt_tokens", 0))
            entry.cached_tokens = int(f.get("cached_tokens", 0))
        elif entry.kind == "error":
            entry.code, entry.message = int(f.get("code", 500)), f.get("message", "")
        return entry


def _spec_stats(text: str) -> SpecStats:
    """SpecStats from its JSON, fields this version does not know skipped (a newer writer's)."""
    known = {f.name for f in dataclass_fields(SpecStats)}
    return SpecStats(**{k: v for k, v in json.loads(text).items() if k in known})


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
