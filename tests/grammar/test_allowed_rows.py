"""The allowed rows (specd/grammar/allowed_rows.py): encoded UTF-16 surrogates, which xgrammar admits
inside strings, never reach the output, in one token or split over two, in every kind of mask
(committed, along drafts, in draft forks); real multi-byte characters split over tokens still do."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from specd.grammar.allowed_rows import VocabBytes
from specd.grammar.backend import GrammarSpec
from specd.grammar.errors import GrammarViolation
from specd.grammar.masking import bitmask_to_bool
from specd.grammar.matcher import SequenceGrammar

# A byte-level vocabulary: one token per byte, then multi-byte tokens, then the stop token.
MULTI_BYTE = [b"\xed\xa0\x80",  # U+D800 encoded: an encoded surrogate in one token
              b"a\xed",  # ends with the lead byte ED
              b"\xa0\x80",  # a second and third byte of a surrogate (or of another 3-byte character)
              b"\xed\x9f\xbf",  # U+D7FF, the last character before the surrogates: valid
              b"\xc3\xa9",  # é
              "😀".encode(),
              b'{"s": "']
VOCAB = [bytes([b]) for b in range(256)] + MULTI_BYTE
STOP = len(VOCAB)
SURROGATE, ENDS_WITH_ED, CONTINUATION_PAIR, LAST_BEFORE_SURROGATES, E_ACUTE, EMOJI, OPEN = range(256, 256 + 7)
SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}


def _byte_level_encoding() -> dict[int, str]:
    """GPT-2's bytes -> printable characters map, as byte-level tokenizers store their vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


@pytest.fixture(scope="module")
def info() -> xgr.TokenizerInfo:
    enc = _byte_level_encoding()
    encoded = ["".join(enc[b] for b in token) for token in VOCAB] + ["</s>"]
    return xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, stop_token_ids=[STOP])


@pytest.fixture(scope="module")
def vocab_bytes(info) -> VocabBytes:
    return VocabBytes.from_vocab(info.decoded_vocab, info.special_token_ids, info.vocab_size)


@pytest.fixture(scope="module")
def compiled(info):
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)


def ours(compiled, vocab_bytes) -> SequenceGrammar:
    return SequenceGrammar(compiled, vocab_bytes.allowed_rows(mask_control_characters=True), closing=None)


def allows(row: torch.Tensor, token: int) -> bool:
    return bool(bitmask_to_bool(row[None], token + 1)[0, token])


def test_raw_xgrammar_accepts_encoded_surrogates(compiled):
    """The gap itself: in one token and byte by byte, and counted as one character of maxLength 3."""
    for pieces in ([SURROGATE], [0xED, 0xA0, 0x80], [0xED, CONTINUATION_PAIR]):
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_token(OPEN)
        assert all(m.accept_token(t) for t in pieces + [SURROGATE, SURROGATE]), pieces
        assert m.accept_token(ord('"')) and m.accept_token(ord("}")) and m.accept_token(STOP)
    # ...which is three characters to Python, nine to jsonschema: not valid UTF-8.
    assert (b"\xed\xa0\x80" * 3).decode(errors="replace") == "\ufffd" * 9


def test_a_surrogate_in_one_token_is_never_allowed(compiled, vocab_bytes):
    g = ours(compiled, vocab_bytes)
    g.commit([OPEN])
    row = g.next_mask()
    assert not allows(row, SURROGATE)
    assert allows(row, LAST_BEFORE_SURROGATES) and allows(row, E_ACUTE) and allows(row, EMOJI)
    with pytest.raises(GrammarViolation):
        g.commit([SURROGATE])
    # regex and EBNF masks too: an encoded surrogate is no text of any grammar (a raw newline is)
    rows = vocab_bytes.allowed_rows(mask_control_characters=False)
    assert not allows(rows.static, SURROGATE) and allows(rows.static, ord("\n"))
    assert not allows(vocab_bytes.allowed_rows(mask_control_characters=True).static, ord("\n"))


@pytest.mark.parametrize("lead", [0xED, ENDS_WITH_ED])
def test_after_a_token_ending_with_ed_no_token_may_start_a_surrogate(compiled, vocab_bytes, lead):
    g = ours(compiled, vocab_bytes)
    g.commit([OPEN, lead])
    row = g.next_mask()
    assert not any(allows(row, b) for b in range(0xA0, 0xC0)) and not allows(row, CONTINUATION_PAIR)
    assert all(allows(row, b) for b in range(0x80, 0xA0))  # ED 80..9F xx: U+D000..U+D7FF
    with pytest.raises(GrammarViolation):
        g.commit([0xA0])
    g.commit([0x9F, 0xBF, ord('"'), ord("}"), STOP])  # U+D7FF is fine
    assert g.is_terminated()


def test_masks_along_drafts_and_draft_forks_follow_the_previous_draft(compiled, vocab_bytes):
    g = ours(compiled, vocab_bytes)
    g.commit([OPEN])
    result = g.mask_along([0xED, 0xA0, 0x80])
    assert result.num_valid_drafts == 1  # the A0 after the drafted ED is forbidden by row 1
    assert allows(result.bitmask[1], 0x80) and not allows(result.bitmask[1], 0xA0)
    assert torch.equal(g.next_mask(), result.bitmask[0])  # the committed state is where it was
    assert g.mask_along([ENDS_WITH_ED, 0xB0]).num_valid_drafts == 1
    fork = g.fork_drafts()
    assert fork.advance(0xED) and not fork.advance(0xA0) and not fork.advance(CONTINUATION_PAIR)
    other = fork.copy()
    assert fork.advance(0x80) and fork.advance(0x80)  # U+D000
    assert not other.advance(0xBF) and other.advance(0x9F)  # the copy is still right after ED
    fork.reset()  # back to the committed state: A0 after ED is checked again from there
    assert fork.advance(ENDS_WITH_ED) and not allows(fork.next_mask(), 0xB0)


def test_multi_byte_characters_split_over_tokens_still_work(compiled, vocab_bytes):
    g = ours(compiled, vocab_bytes)
    split_e_acute, split_emoji = list("é".encode()), list("😀".encode())
    text = [OPEN] + split_e_acute + split_emoji[:2]
    result = g.mask_along(text + split_emoji[2:])
    assert result.num_valid_drafts == len(text) + 2
    g.commit(text)
    g.commit(split_emoji[2:] + [E_ACUTE, ord('"')])  # three characters: maxLength 3
    g.commit([ord("}"), STOP])
    assert g.is_terminated()


@pytest.mark.parametrize("spec,prefix", [
    (GrammarSpec("json_schema", json.dumps(SCHEMA)), b'{"s": "'),
    (GrammarSpec("json_object"), b'{"s": "'),
    (GrammarSpec("regex", r"[a-z]+: .{1,3}"), b"ab: "),
    (GrammarSpec("ebnf", 'root ::= "<" [^>]* ">"'), b"<"),
])
def test_every_grammar_kind_from_the_compiler_cache_masks_them(cache, spec, prefix):
    """The tiny target's byte-level vocabulary (one token per byte): raw xgrammar takes ED A0 80 in
    every kind of grammar; the cache's sequence grammars do not, and take ED 9F BF (U+D7FF)."""
    byte = {bytes(t)[0]: i for i, t in enumerate(cache.tokenizer_info.decoded_vocab) if len(t) == 1}
    opening = [byte[b] for b in prefix]
    surrogate, below = [byte[b] for b in b"\xed\xa0\x80"], [byte[b] for b in b"\xed\x9f\xbf"]
    raw = xgr.GrammarMatcher(cache.compile(spec))
    assert all(raw.accept_token(t) for t in opening + surrogate)
    g = cache.sequence_grammar(spec)
    g.commit(opening + surrogate[:1])
    assert not allows(g.next_mask(), surrogate[1]) and allows(g.next_mask(), below[1])
    with pytest.raises(GrammarViolation):
        g.commit(surrogate[1:])
    g.commit(below[1:])
