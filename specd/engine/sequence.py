"""A request's lifecycle inside the engine: its tokens, parameters, status and speculation stats."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specd.engine.logprobs import TokenLogprob
from specd.grammar.backend import GrammarSpec
from specd.messages import SpecStats
from specd.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: two requests with equal tokens are still two requests
class Sequence:
    """One request. The committed tokens are prompt_token_ids + output_token_ids.

    After prefill, the last committed token has been sampled but not yet run through the target:
    the target's cache holds num_tokens - 1 tokens while the sequence runs.
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "deadline" | "error" (error says why)
    error: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    grammar: GrammarSpec | None = None  # structured output: the grammar every token must follow
    # Output tokens from rows that budget-aware closing changed (forced, or tokens that could not
    # close in time taken out); 0: the output ended on its own, or it is unconstrained.
    num_closing_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first prefill found in the prefix cache
    # Committed since the drafter last saw this sequence, with the target hidden rows that go with
    # them (one row fewer than tokens before the first draft step, as many afterwards).
    undrafted_token_ids: list[int] = field(default_factory=list)
    undrafted_hidden: list[torch.Tensor] = field(default_factory=list)  # each [n_i, H*]
    # With params.logprobs set: one entry per output token, aligned with output_token_ids (None
    # for tokens a resumed request emitted before: those went out already); else stays empty.
    output_logprobs: list[TokenLogprob | None] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def take_undrafted(self) -> tuple[list[int], torch.Tensor | None]:
        """Hand the drafter what it has not seen yet, and forget it here."""
        tokens, self.undrafted_token_ids = self.undrafted_token_ids, []
        pieces, self.undrafted_hidden = self.undrafted_hidden, []
        # One piece (a step's rows, the usual case) goes as it is: a copy of it is a device call a
        # sequence, 128 a step at batch 128.
        hidden = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0) if pieces else None
        return tokens, hidden
