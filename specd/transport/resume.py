"""Where a request stands, read back from its result stream: the resume point after a verifier died.

The result stream is the only record of what the client may already have seen, so a verifier
that reclaims a dead one's request continues from exactly the tokens written there: it
re-prefills prompt + those tokens and samples the rest with the same (seed, position) noise.
Replaying applies the reader's rule (services/gateway/result_reader.py): an entry at `pos` keeps only
its tokens past what is already known, so duplicate deltas of a partly sent pipeline count once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specd.messages import SpecStats
from specd.transport.redis_streams import ResultEntry


class ResultGapError(ValueError):
    """An entry starts past the tokens known so far: the stream lost a write (should not happen)."""


@dataclass
class ResumePoint:
    """What a result stream says of its request."""

    output_token_ids: list[int] = field(default_factory=list)  # written so far, in order
    spec_stats: SpecStats = field(default_factory=SpecStats)  # speculation behind those tokens
    is_answered: bool = False  # a final or error entry is there: nothing left to do

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def replay_results(entries: list[ResultEntry]) -> ResumePoint:
    """Fold a result stream (oldest first) into its resume point."""
    point = ResumePoint()
    for entry in entries:
        if entry.kind == "error":
            point.is_answered = True
            continue
        if entry.kind not in ("delta", "final"):
            continue
        known = point.num_output_tokens
        if entry.pos > known:
            raise ResultGapError(f"result entry at position {entry.pos}, only {known} tokens before it")
        new = entry.tokens[known - entry.pos:]
        if new:
            point.output_token_ids.extend(new)
            if entry.spec_stats is not None:  # the stats that produced these tokens
                point.spec_stats = entry.spec_stats
        if entry.kind == "final":
            point.is_answered = True
            if entry.spec_stats is not None:
                point.spec_stats = entry.spec_stats
    return point
