"""The contract between the engine and whoever holds the grammar matchers.

Per step the engine makes ONE call for all constrained sequences: the tokens committed by the
previous step advance the real matchers, then token bitmasks are computed along this step's draft
tokens on forks of those matchers (the real matchers are never advanced by drafts). The local
backend runs xgrammar in-process; the remote one sends the same call to the grammar service.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]


@dataclass(frozen=True)
class GrammarSpec:
    """What constrains a request. source: schema JSON text, regex, EBNF, or a structural tag's JSON
    text (xgrammar's: free text, tags, triggers; tool calls are built on it); empty for json_object."""

    kind: GrammarKind
    source: str = ""


@dataclass
class MaskResult:
    """Masks along one sequence's drafts.

    bitmask rows are the allowed-token sets at positions 0..num_valid_drafts: row 0 right after the
    committed tokens, row j after drafts 0..j-1. Drafts past num_valid_drafts are not allowed by
    the grammar (the verifier rejects them through the masked target distribution).
    """

    bitmask: torch.Tensor  # [num_valid_drafts + 1, ceil(vocab / 32)] int32 (xgrammar's layout)
    num_valid_drafts: int
    terminated: bool = False  # the real matcher has terminated after the commits
    # The last num_closing_rows rows start at the first row that budget-aware closing changed (it
    # forced the closing suffix's next token or took out tokens that could not close in time).
    num_closing_rows: int = 0


@dataclass
class GrammarStep:
    """One engine step's grammar work."""

    commits: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> tokens accepted last step
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> this step's draft tokens
    # seq_id -> tokens the sequence may still emit at row 0 of this step, its stop token included
    # (absent: no limit). Rows near the end are shaped so the grammar terminates in budget.
    budgets: dict[int, int] = field(default_factory=dict)


class GrammarBackend(Protocol):
    """Holds one matcher per constrained sequence."""

    def open(self, seq_id: int, spec: GrammarSpec, replay_token_ids: list[int] | None = None) -> None:
        """Create a matcher (replaying already accepted tokens when rebuilding one)."""

    def step(self, step: GrammarStep) -> dict[int, MaskResult]:
        """Apply the commits, then mask along the drafts (within step.budgets); one result per seq
        in step.drafts."""

    def close(self, seq_id: int) -> None:
        """Drop the matcher."""
