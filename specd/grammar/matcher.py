"""One constrained sequence's grammar state: the real matcher and the masks along drafts.

The real matcher has accepted exactly the sequence's committed output tokens. Drafts never advance
it for good: mask_along accepts them tentatively and rolls them back, and a drafter that picks
draft tokens one at a time works on a DraftGrammar, a fork of the real matcher.

Bitmask rows use xgrammar's layout: [ceil(vocab / 32)] int32, bit (i % 32) of word i // 32 set when
token i is allowed. A terminated matcher's row allows only the stop tokens, so a row is never
all-zero (an all -inf logits row would turn softmax into NaN).

A grammar may come with allowed rows (allowed_rows.py), ANDed into every mask and checked on every
accepted token: tokens xgrammar admits but no valid output holds. Which row applies depends on the
token before the mask's position, so every matcher keeps the last token it accepted. Given the
tokens a sequence may still emit, mask_along also shapes the rows near the end of that budget
(budget.py), so a constrained response ends complete (finish_reason "stop"), not truncated.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import xgrammar as xgr

from specd.grammar.allowed_rows import AllowedRows
from specd.grammar.backend import MaskResult
from specd.grammar.budget import BudgetCloser, ClosingConfig
from specd.grammar.closing import ClosingPreference
from specd.grammar.errors import GrammarViolation


def _as_int32(word: int) -> int:
    """An unsigned 32-bit word as the int32 xgrammar stores (bit 31 set: negative)."""
    return word - (1 << 32) if word >= 1 << 31 else word


def stop_only_row(stop_token_ids: Sequence[int], bitmask_width: int) -> torch.Tensor:
    """[bitmask_width] int32 row allowing exactly stop_token_ids."""
    words = [0] * bitmask_width
    for token in stop_token_ids:
        words[token // 32] |= 1 << (token % 32)
    return torch.tensor([_as_int32(w) for w in words], dtype=torch.int32)


def _is_allowed(row: torch.Tensor, token_id: int) -> bool:
    """Whether row [W] int32 allows token_id (ids past the row are not allowed)."""
    if not 0 <= token_id < row.shape[0] * 32:
        return False
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


class _MatcherRows:
    """Mask filling and token acceptance shared by SequenceGrammar and DraftGrammar."""

    matcher: xgr.GrammarMatcher
    bitmask_width: int
    stop_token_ids: list[int]
    _stop_row: torch.Tensor  # [bitmask_width] int32: the row once terminated
    _tail_word: int | None  # the last word's valid bits, when vocab_size % 32 != 0
    _stopped_at_dead_end = False  # a stop token ended a dead end (see _fill); xgrammar never saw it
    _allowed: AllowedRows | None = None  # the rows ANDed into every mask
    _last_token: int | None = None  # the last token self.matcher accepted (None: none yet)

    def _allowed_row(self) -> torch.Tensor | None:
        """[bitmask_width] int32: the allowed row at the matcher's state, or None."""
        return None if self._allowed is None else self._allowed.row_after(self._last_token)

    def _fill(self, bitmask: torch.Tensor, index: int) -> None:
        if self.is_terminated():
            bitmask[index] = self._stop_row
            return
        self.matcher.fill_next_token_bitmask(bitmask, index)
        if self._tail_word is not None:  # xgrammar may set the bits of ids >= vocab_size
            bitmask[index, -1] &= self._tail_word
        allowed = self._allowed_row()
        if allowed is not None:
            bitmask[index] &= allowed
        if not bool(bitmask[index].any()):
            # A dead end: the grammar allows nothing here (regex a[^\s\S] after "a"). An all-zero
            # row makes every logit -inf (NaN probabilities); let a stop token end the output.
            bitmask[index] = self._stop_row

    def _accept(self, token_id: int) -> bool:
        """accept_token, and also a stop token at a dead end (which then terminates)."""
        allowed = self._allowed_row()
        if allowed is not None and not _is_allowed(allowed, token_id):
            return False
        if self.matcher.accept_token(token_id):
            self._last_token = token_id
            return True
        if token_id in self.stop_token_ids and self._is_dead_end():
            self._stopped_at_dead_end = True
            return True
        return False

    def _is_dead_end(self) -> bool:
        bitmask = torch.empty((1, self.bitmask_width), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        if self._tail_word is not None:
            bitmask[0, -1] &= self._tail_word
        allowed = self._allowed_row()
        if allowed is not None:
            bitmask[0] &= allowed
        return not bool(bitmask.any())

    def next_mask(self) -> torch.Tensor:
        """[bitmask_width] int32: the tokens allowed next."""
        bitmask = torch.empty((1, self.bitmask_width), dtype=torch.int32)
        self._fill(bitmask, 0)
        return bitmask[0]

    def forced_text(self) -> bytes:
        """The text the grammar forces next (xgrammar's jump-forward string; b"" when none)."""
        if self.is_terminated():
            return b""
        try:
            return self.matcher.find_jump_forward_string().encode()
        except UnicodeDecodeError:  # it stops inside a character: no use for spelling tokens
            return b""

    def is_terminated(self) -> bool:
        """Whether a stop token has been accepted (nothing may follow)."""
        return self._stopped_at_dead_end or self.matcher.is_terminated()


class SequenceGrammar(_MatcherRows):
    """The real matcher of one sequence: commit verified tokens, mask along drafts.

    xgrammar >= 0.2 rolls back any number of tokens (max_rollback_tokens is deprecated and always
    unlimited), so drafts of any length can be masked and rolled back.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, allowed: AllowedRows | None = None, *,
                 closing: ClosingConfig | None = ClosingConfig(),
                 closing_preference: ClosingPreference | Callable[[], ClosingPreference] | None = None) -> None:
        # closing: how rows near the end of a budget are shaped (budget.py; None: never);
        # closing_preference: the vocabulary's, or a factory of it (GrammarCompilerCache shares
        # one); None: built from the tokenizer info the first time a row is shaped.
        info = compiled.tokenizer_info
        self.vocab_size = info.vocab_size
        self.bitmask_width = (self.vocab_size + 31) // 32
        self.stop_token_ids = list(info.stop_token_ids)
        self._stop_row = stop_only_row(self.stop_token_ids, self.bitmask_width)
        num_tail_bits = self.vocab_size % 32
        self._tail_word = None if num_tail_bits == 0 else _as_int32((1 << num_tail_bits) - 1)
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_committed = 0
        if allowed is not None and allowed.bitmask_width != self.bitmask_width:
            raise ValueError(f"allowed: rows of {allowed.bitmask_width} words, expected {self.bitmask_width}")
        self._allowed = allowed
        self.closer = None if closing is None else BudgetCloser(
            closing, closing_preference or (lambda: ClosingPreference.from_tokenizer_info(info)))

    def commit(self, token_ids: Sequence[int]) -> None:
        """Advance the real matcher by verified tokens; all or nothing.

        A token the grammar does not allow raises GrammarViolation (the engine sampled outside the
        mask: a bug) and leaves the matcher where it was before this call.
        """
        was_stopped, last_token = self._stopped_at_dead_end, self._last_token
        num_in_matcher = 0  # tokens xgrammar accepted (a dead-end stop token is not one)
        for i, token in enumerate(token_ids):
            token = int(token)
            if self.is_terminated() or not self._accept(token):
                state = "after the stop token" if self.is_terminated() else "by the grammar"
                if num_in_matcher:
                    self.matcher.rollback(num_in_matcher)
                self._stopped_at_dead_end, self._last_token = was_stopped, last_token
                raise GrammarViolation(f"grammar: committed token {token} (position {self.num_committed + i} "
                                       f"of the output) is not allowed {state}")
            num_in_matcher += not self._stopped_at_dead_end
        self.num_committed += len(token_ids)
        if self.closer is not None:
            self.closer.committed([int(t) for t in token_ids])

    def mask_along(self, draft_token_ids: Sequence[int], tokens_left: int | None = None) -> MaskResult:
        """Masks at positions 0..num_valid_drafts along the drafts; the real state is unchanged.

        Row 0 is the mask after the committed tokens, row j the mask after drafts 0..j-1. The walk
        stops at the first draft the previous row forbids (or the matcher rejects).

        tokens_left: how many tokens the sequence may still emit at row 0, its stop token included
        (None: no limit); row j may emit tokens_left - j. Rows near the end are shaped so that the
        grammar terminates within them (budget.py): a constrained output that would otherwise run
        out of max_tokens mid-value is closed, ending complete and valid with finish_reason "stop".
        The result's last num_closing_rows rows start at the first row that closing changed.
        """
        if tokens_left is not None and (not isinstance(tokens_left, int) or tokens_left < 1):
            raise ValueError(f"tokens_left: must be an integer >= 1 or None, got {tokens_left!r}")
        drafts = [int(t) for t in draft_token_ids]
        terminated = self.is_terminated()
        committed_last_token = self._last_token
        bitmask = torch.empty((len(drafts) + 1, self.bitmask_width), dtype=torch.int32)
        self._fill(bitmask, 0)
        first_closing = None if not self._shape(bitmask, drafts, 0, tokens_left) else 0
        num_valid = 0
        for token in drafts:
            # Checking the row first skips accept_token on forbidden tokens (xgrammar logs those).
            # A stop token at a dead end is allowed by its row but not accepted here: the verifier
            # takes it from that row as the recovered token, and commit() accepts it.
            if self.is_terminated() or not _is_allowed(bitmask[num_valid], token):
                break
            if not self.matcher.accept_token(token):
                break
            self._last_token = token  # the next row's allowed row (and a closing walk's fork) follow it
            num_valid += 1
            self._fill(bitmask, num_valid)
            if self._shape(bitmask, drafts, num_valid, tokens_left) and first_closing is None:
                first_closing = num_valid
        if num_valid:
            self.matcher.rollback(num_valid)
        self._last_token = committed_last_token
        rows = bitmask if num_valid == len(drafts) else bitmask[:num_valid + 1].clone()
        return MaskResult(bitmask=rows, num_valid_drafts=num_valid, terminated=terminated,
                          num_closing_rows=0 if first_closing is None else num_valid + 1 - first_closing)

    def _shape(self, bitmask: torch.Tensor, drafts: list[int], j: int, tokens_left: int | None) -> bool:
        """Budget-aware closing of row j (the matcher is after drafts[:j]); whether it changed it."""
        if tokens_left is None or self.closer is None:
            return False
        # Rows past the budget (more drafts than tokens left) are shaped as its last row.
        return self.closer.shape_row(self, bitmask[j], drafts[:j], max(1, tokens_left - j))

    def fork_drafts(self) -> "DraftGrammar":
        """A DraftGrammar starting from the matcher's state: the committed one (inside mask_along,
        the state after the drafts accepted so far: how closing walks fork)."""
        return DraftGrammar(self)


class DraftGrammar(_MatcherRows):
    """A fork of a sequence's committed state for a drafter that picks draft tokens one at a time.

    next_mask() -> the row to mask the drafter's logits with; advance(token) -> whether the grammar
    allows it (the fork moves on only when it does); reset() -> back to the committed state of the
    parent, including commits made since this fork was taken. The parent is never touched.
    """

    def __init__(self, parent: SequenceGrammar) -> None:
        self.parent = parent
        self.bitmask_width = parent.bitmask_width
        self.stop_token_ids = parent.stop_token_ids
        self._stop_row = parent._stop_row
        self._tail_word = parent._tail_word
        self._allowed = parent._allowed
        self.reset()

    def advance(self, token_id: int) -> bool:
        """Accept one draft token; False (state unchanged) when the grammar forbids it."""
        if self.is_terminated() or not self._accept(int(token_id)):
            return False
        self.num_drafted += 1
        return True

    def reset(self) -> None:
        """Forget the drafted tokens: fork the parent's current committed state again."""
        self.matcher = self.parent.matcher.fork()
        self._stopped_at_dead_end = self.parent._stopped_at_dead_end
        self._last_token = self.parent._last_token
        self.num_drafted = 0

    def copy(self) -> "DraftGrammar":
        """An independent fork of this fork's state (same parent): for trying a token out."""
        other = copy.copy(self)
        other.matcher = self.matcher.fork()
        return other
