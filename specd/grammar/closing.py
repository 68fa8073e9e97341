"""The closing walk: a short completion that takes a grammar from its state to termination.

A constrained request that runs out of max_tokens before its grammar terminates would end truncated
(finish_reason "length", unparseable JSON). Instead, once the tokens left are barely enough, the
sequence is forced through a closing suffix that reaches termination (stop token included), so the
response ends complete, with "stop". budget.py decides when; this module finds suffixes.

The suffix is a greedy walk on a fork of the matcher. At each state it takes the longest token
spelling a prefix of the literal text the grammar forces next (xgrammar's jump-forward string);
otherwise the allowed token ClosingPreference ranks first, unless it leaves the mask as it was (a
loop: the `1` of `[0-9]+#`), then the next that changes the mask (among MAX_TRIALS), else one that
changes it two tokens on (_progress). Consecutive picks merge where the vocabulary has the merged
token. Each pick depends on the grammar state alone, so once closing is engaged the output is
deterministic and speculative decoding masks exactly as target-only decoding does.

The preference, ranked once per tokenizer: (a) a stop token; (b) tokens made only of `"`, `}`, `]`
(_closing_key orders them); (c) values that end at once (`""`, `[]`, `{}`, `null`, `true`,
`false`); (d) everything else, shortest text first, whitespace-only last (a grammar may loop on
whitespace for ever), ties by _CHAR_ORDER, then token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specd.grammar.masking import bool_to_bitmask

_CLOSING_BYTES = frozenset(b'"}]')
# `0` is no quick value here: ranked first it would also win inside date strings, and the year
# 0000 is invalid; `1` comes first among digits in tier (d) and ends a number as quickly.
_QUICK_VALUES = (b'""', b"[]", b"{}", b"null", b"true", b"false")
_WHITESPACE = frozenset(b" \t\n\r")
# Bytes that open JSON structure (a member, an item, an object, an array, a string): a token holding
# one may lengthen the closing suffix by many tokens (a `,` starting an item of required fields).
_RISKY_BYTES = frozenset(b'",{[:')
# Letters that no JSON keyword or number holds: a mask allowing them all is inside a string, where
# `"` closes and `}` or `]` are mere content.
_STRING_PROBES = (b"q", b"x", b"z")
# Tie order of characters in tier (d). JSON's separators first (a number ends at the next `,`, not
# after more digits); `Z` (a date-time ends there, not after more fraction digits); delimiters
# that patterns and formats (emails, uris, ip addresses) need to progress; digits, 1 first (a
# complete number, and "1111-11-11" is a valid date where "0000-00-00" is not), before `-` (a
# number starts with 1, not -1); letters.
_CHAR_ORDER = (b'"}],:Z@#.1023456789-/_T' + bytes(range(ord("a"), ord("z") + 1))
               + bytes(range(ord("A"), ord("Z") + 1)))
_SHIFTS = torch.arange(32, dtype=torch.int32)
MAX_TRIALS = 32  # tokens tried per walk step for one that makes progress (_progress)
LOOP_PROBE = 16  # repeats of a walk step's first token that tell a bound from a loop (_progress)
LOOKAHEAD_WIDTH = 8  # first tokens tried two tokens deep when the first one loops (_progress)
_HEAD = 256  # best() looks among this many most preferred tokens first


def _closing_key(text: bytes, in_string: bool) -> tuple:
    """Order within tier (b). Inside a string: led by `"` (it closes the string) first, most
    brackets first (`"]}` closes three levels). Outside: led by `}` or `]` first, most brackets
    first; then `""` (an empty string value), `"`, the others."""
    brackets = -sum(b in b"}]" for b in text)
    if in_string:
        return (text[0] != ord('"'), brackets, -len(text))
    if text[0] != ord('"'):
        return (0, brackets, -len(text))
    return (1, {b'""': 0, b'"': 1}.get(text, 2), brackets, -len(text))


def _byte_ranks() -> list[int]:
    ranks = [len(_CHAR_ORDER) + b for b in range(256)]
    for i, b in enumerate(_CHAR_ORDER):
        ranks[b] = min(ranks[b], i)
    return ranks


def _is_allowed(row: torch.Tensor, token_id: int) -> bool:
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


@dataclass(frozen=True)
class ClosingPreference:
    """How the closing walk picks tokens, for one vocabulary (module docstring).

    rank / rank_in_string: [32 * bitmask_width] int64, rank[token] = its place in the preference
    (0 = first) outside strings / inside them; they differ in tier (b) only. Ids past the
    vocabulary rank last (masks never allow them). by_text: token bytes -> the id the preference
    ranks first among tokens with those bytes, for spelling forced text.
    """

    rank: torch.Tensor  # [32 * W] int64, a permutation of 0..32W-1
    rank_in_string: torch.Tensor  # [32 * W] int64, the same inside a string
    bitmask_width: int
    by_text: dict[bytes, int]
    max_token_bytes: int
    texts: tuple[bytes, ...]  # [vocab_size] each token's bytes (b"" for special and stop tokens)
    risky_row: torch.Tensor  # [W] int32: the tokens holding one of _RISKY_BYTES (see risky())
    risky_in_string_row: torch.Tensor  # [W] int32: those holding `"`, but tier (b)
    probe_ids: tuple[int, ...]  # the tokens of _STRING_PROBES (in_string)
    closers: frozenset[int]  # outside strings: stop tokens, tier (b) tokens led by `}` or `]`
    string_closers: frozenset[int]  # inside strings: stop tokens, tier (b) tokens led by `"`

    @classmethod
    def from_vocab(cls, decoded_vocab: Sequence[bytes], stop_token_ids: Sequence[int],
                   special_token_ids: Sequence[int], vocab_size: int) -> "ClosingPreference":
        """decoded_vocab: each token's bytes (xgrammar's TokenizerInfo.decoded_vocab)."""
        width = (vocab_size + 31) // 32
        stops, special = set(stop_token_ids), set(special_token_ids)
        byte_rank = _byte_ranks()
        quick = {text: i for i, text in enumerate(_QUICK_VALUES)}
        texts = [bytes(decoded_vocab[i]) if i < len(decoded_vocab) else b"" for i in range(vocab_size)]
        plain = [i for i in range(vocab_size) if texts[i] and i not in special and i not in stops]
        closing = {i for i in plain if set(texts[i]) <= _CLOSING_BYTES}

        def key(token_id: int, in_string: bool) -> tuple:
            text = texts[token_id]
            if token_id in stops:
                return (0, token_id)
            if token_id in special or not text:
                return (4, token_id)
            spelled = tuple(byte_rank[b] for b in text)
            if token_id in closing:
                return (1, *_closing_key(text, in_string), spelled, token_id)
            if text in quick:
                return (2, quick[text], token_id)
            return (3, set(text) <= _WHITESPACE, len(text), spelled, token_id)

        def ranks(in_string: bool) -> torch.Tensor:
            order = sorted(range(vocab_size), key=lambda i: key(i, in_string)) + list(range(vocab_size, width * 32))
            rank = torch.empty(width * 32, dtype=torch.int64)
            rank[torch.tensor(order)] = torch.arange(width * 32)
            return rank

        rank = ranks(False)
        by_text: dict[bytes, int] = {}
        for token_id in sorted(plain, key=lambda i: int(rank[i])):
            by_text.setdefault(texts[token_id], token_id)
        risky = torch.zeros((2, vocab_size), dtype=torch.bool)
        risky[0, [i for i in plain if set(texts[i]) & _RISKY_BYTES]] = True
        risky[1, [i for i in plain if ord('"') in texts[i] and i not in closing]] = True
        risky_rows = bool_to_bitmask(risky)
        plain_set = set(plain)
        plain_texts = tuple(texts[i] if i in plain_set else b"" for i in range(vocab_size))
        return cls(rank, ranks(True), width, by_text, max((len(t) for t in by_text), default=0), plain_texts,
                   risky_rows[0], risky_rows[1], tuple(by_text[p] for p in _STRING_PROBES if p in by_text),
                   frozenset(stops | {i for i in closing if texts[i][0] in b"}]"}),
                   frozenset(stops | {i for i in closing if texts[i][0] == ord('"')}))

    @classmethod
    def from_tokenizer_info(cls, info) -> "ClosingPreference":
        """From an xgrammar TokenizerInfo."""
        return cls.from_vocab(info.decoded_vocab, info.stop_token_ids, info.special_token_ids, info.vocab_size)

    def in_string(self, row: torch.Tensor) -> bool:
        """Whether row looks like the inside of a string: it allows every probe letter."""
        return bool(self.probe_ids) and all(_is_allowed(row, t) for t in self.probe_ids)

    def __post_init__(self) -> None:
        heads = []
        for rank in (self.rank, self.rank_in_string):
            ids = torch.argsort(rank)[:_HEAD]  # [_HEAD] the most preferred tokens, in order
            heads.append((ids, ids // 32, (ids % 32).to(torch.int32)))
        object.__setattr__(self, "_heads", tuple(heads))

    def best(self, row: torch.Tensor) -> int:
        """The first token in the preference that the [W] int32 bitmask row allows."""
        in_string = self.in_string(row)
        ids, words, shifts = self._heads[in_string]  # most picks are among the first few tokens
        hits = ((row[words] >> shifts) & 1).nonzero()
        if hits.numel():
            return int(ids[hits[0, 0]])
        return self._ranked(row, 1, in_string)[0]

    def ranked(self, row: torch.Tensor, n: int) -> list[int]:
        """The first n tokens (fewer when fewer are allowed) of the preference that row allows."""
        return self._ranked(row, n, self.in_string(row))

    def _ranked(self, row: torch.Tensor, n: int, in_string: bool) -> list[int]:
        assert row.ndim == 1 and row.shape[0] == self.bitmask_width, tuple(row.shape)
        allowed = ((row.unsqueeze(-1) >> _SHIFTS) & 1).bool().view(-1)  # [32 * W]
        rank = self.rank_in_string if in_string else self.rank
        ranks = torch.where(allowed, rank, rank.shape[0])  # rank is a permutation: ids back
        if n == 1:
            return [int(ranks.argmin())]
        n = min(n, int(allowed.sum()))
        return torch.topk(ranks, n, largest=False, sorted=True).indices.tolist()

    def risky(self, row: torch.Tensor) -> torch.Tensor:
        """[W] int32: the tokens that may lengthen the closing suffix by many tokens, at row's state.
        Outside a string: those holding `"` (it may open a new member) or `,{[:`. Inside one, `,{[:`
        are content and `"`, `"}`... close it: only those that go on past the string (`", "`)."""
        return self.risky_in_string_row if self.in_string(row) else self.risky_row

    def is_progress(self, token_id: int, row: torch.Tensor) -> bool:
        """Whether token_id, allowed by row, closes something by definition (a stop token, `}`
        outside a string, `"` inside one): the walk takes it without trying it out."""
        return token_id in (self.string_closers if self.in_string(row) else self.closers)

    def spell(self, row: torch.Tensor, forced_text: bytes) -> int | None:
        """The longest allowed token spelling a prefix of forced_text (the text the grammar forces
        next), or None."""
        for n in range(min(len(forced_text), self.max_token_bytes), 0, -1):
            token = self.by_text.get(forced_text[:n])
            if token is not None and _is_allowed(row, token):
                return token
        return None


class ClosingWalker(Protocol):
    """A matcher fork the walk may advance (DraftGrammar is one)."""

    def next_mask(self) -> torch.Tensor: ...  # [W] int32, never all-zero

    def forced_text(self) -> bytes: ...  # the text the grammar forces next (b"" when none)

    def advance(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...

    def copy(self) -> "ClosingWalker": ...  # an independent fork of the same state


def closing_suffix(fork: ClosingWalker, preference: ClosingPreference, max_tokens: int,
                   max_trials: int = MAX_TRIALS) -> list[int] | None:
    """The greedy closing walk from fork's state: the tokens up to and including the stop token.

    None when the grammar does not terminate within max_tokens tokens (stop token included); []
    when it already has. fork may be advanced: pass one you may throw away.

    Consecutive picks are merged into one token when the vocabulary has their concatenation and
    the grammar allows it (` ` then `1` is ` 1`; `}` then `,` is `},`): the grammar reads bytes,
    so the state after it is the same, and a suffix of the merged walk is still the walk from
    where it starts (the merging restarts at every token boundary).
    """
    suffix: list[int] = []
    steps = _picks(fork, preference, max_trials)
    mask, token = next(steps, (None, None))  # the mask at a token's start, the token
    while token is not None:
        if len(suffix) == max_tokens:
            return None
        text = preference.texts[token]
        for next_mask, next_token in steps:
            more = preference.texts[next_token]
            merged = preference.by_text.get(text + more) if text and more else None
            if merged is None or not _is_allowed(mask, merged):
                suffix.append(token)
                mask, token = next_mask, next_token
                break
            token, text = merged, text + more
        else:
            suffix.append(token)
            token = None
    return suffix


def _picks(fork: ClosingWalker, preference: ClosingPreference, max_trials: int):
    """The walk's picks, one token at a time: (the mask before it, the token), to termination."""
    mask = None
    while not fork.is_terminated():
        mask = fork.next_mask() if mask is None else mask
        token = preference.spell(mask, fork.forced_text())
        if token is not None:
            _advance(fork, token)
            yield mask, token
            mask = None
        else:
            after, next_mask, token = _progress(fork, mask, preference, max_trials)
            yield mask, token
            fork, mask = after, next_mask


def _progress(fork: ClosingWalker, mask: torch.Tensor, preference: ClosingPreference, max_trials: int):
    """(fork after the token, its next mask or None, the token): the first of the preference's
    tokens whose acceptance changes the mask (or terminates), among its first max_trials. A token
    that leaves the mask as it was most likely loops (the `1` of `[0-9]+#`, a `null` inside a uri):
    the walk would repeat it for ever.

    When no single token changes the mask, the change is further away, for one of two reasons. The
    first token counts towards a bound: the mask of `[0-9]{4}` changes after the fourth digit, and
    repeating the first token gets there (LOOP_PROBE tokens at most). Or it loops, and the change
    takes other tokens: after `@` in `@[\\w.-]+\\.[\\w.-]+` the mask allows the same characters until
    a `.` and one more character have come, and `Z` (the first token) leaves the state as it was.
    Then the first of the LOOKAHEAD_WIDTH most preferred tokens after which a second token changes
    the mask is taken. Else the first token (the walk goes on, and may end at its max_tokens)."""
    candidates = [preference.best(mask)]
    if preference.is_progress(candidates[0], mask):  # a `}` may leave the mask as it was (the
        _advance(fork, candidates[0])  # enclosing object allows `,` and `}` too): no trial
        return fork, None, candidates[0]
    unchanged = []  # the forks after candidates[:len(unchanged)], each with the mask as it was
    while len(unchanged) < len(candidates):
        token = candidates[len(unchanged)]
        trial = fork.copy()
        _advance(trial, token)
        if trial.is_terminated() or preference.is_progress(token, mask):
            return trial, None, token
        after = trial.next_mask()
        if not torch.equal(after, mask):
            return trial, after, token
        unchanged.append(trial)
        if len(unchanged) == 1 and max_trials > 1:
            candidates = preference.ranked(mask, max_trials)
    if _changes_when_repeated(unchanged[0], candidates[0], mask, LOOP_PROBE):
        return unchanged[0], mask, candidates[0]
    for token, trial in zip(candidates[:LOOKAHEAD_WIDTH], unchanged):
        if any(_changes_after(trial, second, mask) for second in candidates):
            return trial, mask, token
    return unchanged[0], mask, candidates[0]


def _changes_after(fork: ClosingWalker, token: int, mask: torch.Tensor) -> bool:
    """Whether accepting token (allowed by mask, fork's mask) on a copy of fork changes its mask."""
    trial = fork.copy()
    _advance(trial, token)
    return trial.is_terminated() or not torch.equal(trial.next_mask(), mask)


def _changes_when_repeated(fork: ClosingWalker, token: int, mask: torch.Tensor, max_repeats: int) -> bool:
    """Whether repeating token (allowed by mask, fork's mask) changes the mask within max_repeats."""
    trial = fork.copy()
    for _ in range(max_repeats):
        _advance(trial, token)
        if trial.is_terminated() or not torch.equal(trial.next_mask(), mask):
            return True
    return False


def _advance(fork: ClosingWalker, token: int) -> None:
    if not fork.advance(token):  # the mask allowed it: only a matcher bug gets here
        raise RuntimeError(f"closing walk: token {token} allowed by the mask but rejected")
