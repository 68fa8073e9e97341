"""Budget-aware closing of one sequence's mask rows: when few tokens are left, end the output in time.

`left` is what a sequence may still emit at a row, stop token included (row j of a step has the
step's budget minus j); a grammar state's closing suffix is closing.py's greedy walk from it to
termination; slack = left - len(suffix). Rows with left <= horizon are shaped, others never touched:
  - forced (slack <= margin): one-hot at the suffix's first token, so the grammar terminates and
    the stop token comes within the budget (finish_reason "stop", not "length").
  - restricted (margin < slack <= reserve): tokens after which the grammar could no longer
    terminate within left - 1 tokens are taken out (a `,` opening an array item of required fields
    lengthens the suffix by tens of tokens). Every allowed token is checked when there are at most
    max_checks; otherwise only the risky ones (ClosingPreference.risky), all of them taken out but
    the suffix's first when there are more. Tokens with the same mask and forced text share a walk.
    The margin covers unchecked tokens' small jumps (UTF-8 lead bytes, escapes, a number's `.`).
  - free: more slack, or no suffix within horizon tokens (the output ends with "length").

Every row is a function of the token prefix and `left` alone, never of a step's draft count, so
greedy speculative output equals non-speculative output token for token. A state's suffix is
cached as a ClosingPath, reused along it and by commits that follow it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specd.grammar.closing import ClosingPreference, closing_suffix

if TYPE_CHECKING:
    from specd.grammar.matcher import SequenceGrammar

# Defaults, from closing walks on the jsonschemabench schemas with the trained tokenizer: suffixes
# from a fresh state reach 67 tokens; one token lengthened a suffix by up to 41 tokens.
CLOSING_HORIZON = 128  # rows with at most this many tokens left are shaped
CLOSING_RESERVE = 64  # rows with at most this much slack are restricted
CLOSING_MARGIN = 4  # forced while the slack is at most this (covers jumps of up to margin + 1)
CLOSING_MAX_CHECKS = 128  # tokens checked per restricted row, at most (a string allows ~40 that end it)
_SHIFTS = torch.arange(32, dtype=torch.int32)


def _as_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


@dataclass(frozen=True, slots=True)
class ClosingConfig:
    """How rows near the end of the budget are shaped (module docstring)."""

    horizon: int = CLOSING_HORIZON
    reserve: int = CLOSING_RESERVE
    margin: int = CLOSING_MARGIN
    max_checks: int = CLOSING_MAX_CHECKS

    def __post_init__(self) -> None:
        if not isinstance(self.horizon, int) or self.horizon < 1:
            raise ValueError(f"horizon: must be an integer >= 1, got {self.horizon!r}")
        if not isinstance(self.margin, int) or not 0 <= self.margin < self.horizon:
            raise ValueError(f"margin: must be an integer in [0, horizon), got {self.margin!r}")
        if not isinstance(self.reserve, int) or not self.margin <= self.reserve <= self.horizon:
            raise ValueError(f"reserve: must be an integer in [margin, horizon], got {self.reserve!r}")
        if not isinstance(self.max_checks, int) or self.max_checks < 0:
            raise ValueError(f"max_checks: must be an integer >= 0, got {self.max_checks!r}")


@dataclass(frozen=True, slots=True)
class ClosingPath:
    """A closing suffix that starts after `prefix`, the tokens past the committed ones."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    def suffix_after(self, tokens: Sequence[int]) -> tuple[int, ...] | None:
        """The closing suffix of the state after `tokens` (past the committed ones), if on the path."""
        n = len(self.prefix)
        if len(tokens) < n or tuple(tokens[:n]) != self.prefix:
            return None
        walked = tuple(tokens[n:])
        if len(walked) >= len(self.suffix) or self.suffix[:len(walked)] != walked:
            return None
        return self.suffix[len(walked):]

    def after_commit(self, tokens: Sequence[int]) -> "ClosingPath | None":
        """The same path once `tokens` are committed; None when they leave it."""
        tokens = tuple(tokens)
        if len(tokens) <= len(self.prefix):
            return ClosingPath(self.prefix[len(tokens):], self.suffix) if self.prefix[:len(tokens)] == tokens else None
        rest = self.suffix_after(tokens)
        return None if rest is None else ClosingPath((), rest)


class BudgetCloser:
    """Shapes one sequence's rows near the end of its budget; keeps the closing path and counters.

    preference: the vocabulary's ClosingPreference, or a zero-argument factory (built on first use).
    """

    def __init__(self, config: ClosingConfig, preference: ClosingPreference | Callable[[], ClosingPreference]) -> None:
        self.config = config
        self._preference = preference
        self.path: ClosingPath | None = None
        self.num_walks = 0  # closing walks (a check is one too)
        self.walk_seconds = 0.0
        self.num_forced_rows = 0
        self.num_restricted_rows = 0

    @property
    def preference(self) -> ClosingPreference:
        if callable(self._preference):
            self._preference = self._preference()
        return self._preference

    def committed(self, tokens: Sequence[int]) -> None:
        """The sequence committed tokens: keep the path when they follow it."""
        if self.path is not None:
            self.path = self.path.after_commit(tokens)

    def shape_row(self, grammar: SequenceGrammar, row: torch.Tensor, drafted: Sequence[int], left: int) -> bool:
        """Shape row [W] int32 in place; True when that changed it (forced, or tokens taken out).

        grammar: the SequenceGrammar, its matcher at the state after `drafted` (tokens past the
        committed ones, accepted tentatively); left: the tokens left at this row.
        """
        if left > self.config.horizon or grammar.is_terminated():
            return False
        suffix = self.suffix(grammar, drafted)
        if suffix is None:
            return False
        first = suffix[0]
        slack = left - len(suffix)
        if slack <= self.config.margin:
            row.zero_()
            row[first // 32] = _as_int32(1 << (first % 32))
            self.num_forced_rows += 1
            return True
        return slack <= self.config.reserve and self._restrict(grammar, row, first, left)

    def suffix(self, grammar: SequenceGrammar, drafted: Sequence[int]) -> tuple[int, ...] | None:
        """The closing suffix of the state after `drafted`: from the path, else by a walk."""
        if self.path is not None:
            known = self.path.suffix_after(drafted)
            if known is not None:
                return known
        found = self._walk(grammar, self.config.horizon)
        if found is None:
            return None
        self.path = ClosingPath(tuple(drafted), tuple(found))
        return self.path.suffix

    def _walk(self, grammar: SequenceGrammar, max_tokens: int) -> list[int] | None:
        """The closing suffix of the matcher's state (after the drafts), walked on a fork."""
        t0 = time.perf_counter()
        found = closing_suffix(grammar.fork_drafts(), self.preference, max_tokens)
        self.num_walks += 1
        self.walk_seconds += time.perf_counter() - t0
        return found

    def _restrict(self, grammar: SequenceGrammar, row: torch.Tensor, first: int, left: int) -> bool:
        """Take out the allowed tokens after which the grammar cannot terminate in left - 1 tokens;
        whether any was."""
        t0 = time.perf_counter()
        allowed = ((row.unsqueeze(-1) >> _SHIFTS) & 1).bool().view(-1)  # [32 * W]
        allowed[first] = False  # the suffix's first token always fits
        candidates = allowed.nonzero().flatten()
        if candidates.numel() > self.config.max_checks:
            risky_row = self.preference.risky(row)
            candidates = (allowed & ((risky_row.unsqueeze(-1) >> _SHIFTS) & 1).bool().view(-1)).nonzero().flatten()
            if candidates.numel() > self.config.max_checks:  # too many to check: all out
                row &= ~risky_row
                row[first // 32] = _as_int32((int(row[first // 32]) & 0xFFFFFFFF) | (1 << (first % 32)))
                self.num_restricted_rows += 1
                return True
        # Tokens that lead to the same next mask and forced text are taken to lead to the same state
        # (`x",` and `",` inside a string): one walk per such group.
        groups: dict[tuple, tuple[object, list[int]]] = {}
        for token in candidates.tolist():
            fork = grammar.fork_drafts()  # where the matcher is: after the drafts
            if not fork.advance(token) or fork.is_terminated():
                continue  # the grammar (or a stop token) ends it: fits
            key = (fork.forced_text(), fork.next_mask().numpy().tobytes())
            groups.setdefault(key, (fork, []))[1].append(token)
        removed = False
        for fork, tokens in groups.values():
            self.num_walks += 1
            if closing_suffix(fork, self.preference, left - 1) is None:
                for token in tokens:
                    row[token // 32] = _as_int32((int(row[token // 32]) & ~(1 << (token % 32))) & 0xFFFFFFFF)
                removed = True
        self.num_restricted_rows += removed
        self.walk_seconds += time.perf_counter() - t0
        return removed
