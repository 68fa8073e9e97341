"""The token rows ANDed into every grammar mask: what xgrammar admits but no valid output holds.

Two gaps of xgrammar 0.2.9 are closed here, per vocabulary, once:
  - Raw control characters (bytes < 0x20) inside bounded JSON strings (xgrammar issue #800). Our
    JSON grammars use compact separators, so no valid JSON output holds one: JSON grammars mask
    every token that does.
  - UTF-8-encoded UTF-16 surrogates (U+D800..U+DFFF: bytes ED A0..BF xx). xgrammar's UTF-8 check
    rejects overlong forms, bytes past U+10FFFF and stray continuation bytes, but accepts these
    three bytes as one character, which is not valid UTF-8: Python decodes them to three U+FFFD
    (so a string the grammar counted as maxLength n is longer for jsonschema). After the lead byte
    ED a valid second byte is 80..9F, never A0..BF. Every grammar kind masks them: a token whose
    own bytes hold ED A0..BF never, and a token starting with A0..BF right after a token that
    ends with ED. Which row applies depends on the previous token only (a table look-up, no walk
    over the vocabulary at step time); ED is always a lead byte, so the byte before it never
    matters.
Special tokens (stop tokens among them) have no bytes here and are left to the grammar.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd.grammar.masking import bool_to_bitmask

_CONTROL_CHARACTER = re.compile(rb"[\x00-\x1f]")
_ENCODED_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE_LEAD = 0xED
_SURROGATE_SECOND_BYTES = range(0xA0, 0xC0)  # what follows ED in an encoded surrogate


@dataclass(frozen=True)
class AllowedRows:
    """The rows one grammar's masks are ANDed with; row_after picks one per mask row."""

    static: torch.Tensor  # [bitmask_width] int32: tokens allowed whatever came before
    after_surrogate_lead: torch.Tensor  # [bitmask_width] int32: static minus tokens led by A0..BF
    ends_with_surrogate_lead: frozenset[int]  # token ids whose bytes end with ED

    def __post_init__(self) -> None:
        if self.static.ndim != 1 or self.static.dtype != torch.int32:
            raise ValueError(f"static: expected [W] int32, got {list(self.static.shape)} {self.static.dtype}")
        if self.after_surrogate_lead.shape != self.static.shape:
            raise ValueError(f"after_surrogate_lead: expected {list(self.static.shape)}, "
                             f"got {list(self.after_surrogate_lead.shape)}")

    @property
    def bitmask_width(self) -> int:
        return self.static.shape[0]

    def row_after(self, last_token: int | None) -> torch.Tensor:
        """[bitmask_width] int32: the row for the mask right after last_token (None: at the start)."""
        if last_token is not None and last_token in self.ends_with_surrogate_lead:
            return self.after_surrogate_lead
        return self.static


@dataclass(frozen=True)
class VocabBytes:
    """Per-token byte facts of one vocabulary, [vocab_size] bool each (special tokens: all False)."""

    has_control_character: torch.Tensor
    has_encoded_surrogate: torch.Tensor
    starts_with_surrogate_second_byte: torch.Tensor
    ends_with_surrogate_lead: torch.Tensor

    @classmethod
    def from_vocab(cls, decoded_vocab: Sequence[bytes], special_token_ids: Sequence[int],
                   vocab_size: int) -> "VocabBytes":
        """decoded_vocab: each token's bytes (xgrammar's TokenizerInfo.decoded_vocab); ids past it
        (the model's padding rows) count as special."""
        special = set(special_token_ids)
        texts = [b"" if i in special or i >= len(decoded_vocab) else bytes(decoded_vocab[i])
                 for i in range(vocab_size)]
        return cls(torch.tensor([_CONTROL_CHARACTER.search(t) is not None for t in texts], dtype=torch.bool),
                   torch.tensor([_ENCODED_SURROGATE.search(t) is not None for t in texts], dtype=torch.bool),
                   torch.tensor([t[:1] != b"" and t[0] in _SURROGATE_SECOND_BYTES for t in texts], dtype=torch.bool),
                   torch.tensor([t[-1:] == bytes([_SURROGATE_LEAD]) for t in texts], dtype=torch.bool))

    def allowed_rows(self, *, mask_control_characters: bool) -> AllowedRows:
        """The rows for a grammar kind: JSON kinds also mask raw control characters."""
        static = ~self.has_encoded_surrogate
        if mask_control_characters:
            static &= ~self.has_control_character
        rows = bool_to_bitmask(torch.stack([static, static & ~self.starts_with_surrogate_second_byte]))
        ends = frozenset(self.ends_with_surrogate_lead.nonzero().flatten().tolist())
        return AllowedRows(rows[0], rows[1], ends)
