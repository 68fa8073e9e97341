"""SequenceGrammar.mask_along / commit and DraftGrammar against a plain xgrammar matcher."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from specd.grammar.backend import GrammarSpec
from specd.grammar.matcher import GrammarViolation, SequenceGrammar, stop_only_row

SCHEMA = GrammarSpec("json_schema", '{"type": "object", "properties": {"name": {"type": "string"}, '
                                    '"n": {"type": "integer"}}, "required": ["name", "n"]}')
TEXT = '{"name": "ada", "n": 12}'


@pytest.fixture
def compiled(cache):
    return cache.compile(SCHEMA)


@pytest.fixture
def ids(tokenizer):
    return tokenizer.encode(TEXT, add_special_tokens=False)


def plain_masks(compiled, committed: list[int], drafts: list[int]) -> torch.Tensor:
    """Rows a fresh xgrammar matcher fills while accepting committed + drafts one by one."""
    m = xgr.GrammarMatcher(compiled)
    for t in committed:
        assert m.accept_token(t)
    rows = xgr.allocate_token_bitmask(len(drafts) + 1, compiled.tokenizer_info.vocab_size)
    m.fill_next_token_bitmask(rows, 0)
    for j, t in enumerate(drafts):
        assert m.accept_token(t)
        if m.is_terminated():
            return rows[:j + 2]  # the row after a stop token is ours (stop-only); compare up to it
        m.fill_next_token_bitmask(rows, j + 1)
    return rows


@pytest.mark.parametrize("split", [0, 1, 3, 5])
def test_mask_along_equals_plain_matcher_and_leaves_state(compiled, ids, split):
    g = SequenceGrammar(compiled)
    g.commit(ids[:split])
    before = g.next_mask().clone()
    drafts = ids[split:split + 4]
    result = g.mask_along(drafts)
    assert result.num_valid_drafts == len(drafts) and result.bitmask.shape == (len(drafts) + 1, 16)
    assert torch.equal(result.bitmask, plain_masks(compiled, ids[:split], drafts))
    assert torch.equal(g.next_mask(), before)  # real matcher unchanged
    assert torch.equal(g.mask_along(drafts).bitmask, result.bitmask)  # and repeatable
    assert g.num_committed == split and not result.terminated


def test_mask_along_stops_at_the_first_forbidden_draft(compiled, ids, tokenizer):
    g = SequenceGrammar(compiled)
    g.commit(ids[:2])
    before = g.next_mask().clone()
    bad = tokenizer.encode("}", add_special_tokens=False)[0]  # '}' cannot follow '{"name'
    drafts = [ids[2], bad, ids[3]]
    result = g.mask_along(drafts)
    assert result.num_valid_drafts == 1 and result.bitmask.shape[0] == 2
    assert torch.equal(result.bitmask, plain_masks(compiled, ids[:2], drafts[:1]))
    assert torch.equal(g.next_mask(), before)
    assert g.mask_along([bad]).num_valid_drafts == 0
    assert g.mask_along([]).bitmask.shape == (1, 16)  # no drafts: row 0 only
    assert g.mask_along([10_000]).num_valid_drafts == 0  # out of the vocabulary


def test_commit_of_a_forbidden_token_raises_and_changes_nothing(compiled, ids, tokenizer):
    g = SequenceGrammar(compiled)
    g.commit(ids[:2])
    before = g.next_mask().clone()
    bad = tokenizer.encode("}", add_special_tokens=False)[0]
    with pytest.raises(GrammarViolation, match=f"committed token {bad} \\(position 3"):
        g.commit([ids[2], bad])
    assert g.num_committed == 2 and torch.equal(g.next_mask(), before)
    g.commit(ids[2:])  # still usable


def test_eos_terminates_and_masks_after_it_allow_only_stop_tokens(compiled, ids, allowed_ids):
    g = SequenceGrammar(compiled)
    g.commit(ids)
    assert allowed_ids(g.next_mask()) == [1, 3]
    result = g.mask_along([3, 5])
    assert result.num_valid_drafts == 1 and allowed_ids(result.bitmask[1]) == [1, 3]
    assert not g.is_terminated()
    g.commit([1])
    assert g.is_terminated() and g.mask_along([3]).terminated
    assert allowed_ids(g.next_mask()) == [1, 3]  # never an all-zero row
    with pytest.raises(GrammarViolation, match="after the stop token"):
        g.commit([3])


def test_draft_grammar_forks_and_resets(compiled, ids, tokenizer):
    g = SequenceGrammar(compiled)
    g.commit(ids[:1])
    committed_row = g.next_mask().clone()
    d = g.fork_drafts()
    assert torch.equal(d.next_mask(), committed_row)
    bad = tokenizer.encode("}", add_special_tokens=False)[0]
    rows = []
    for t in ids[1:4]:
        assert d.advance(t)
        rows.append(d.next_mask())
    assert not d.advance(bad) and d.num_drafted == 3
    expected = g.mask_along(ids[1:4]).bitmask[1:]
    assert torch.equal(torch.stack(rows), expected)
    assert torch.equal(g.next_mask(), committed_row)  # the parent never moved
    g.commit(ids[1:2])
    d.reset()  # back to the parent's committed state, including the new commit
    assert d.num_drafted == 0 and torch.equal(d.next_mask(), g.next_mask())


def test_stop_only_row_sets_exactly_those_bits(allowed_ids):
    assert allowed_ids(stop_only_row([0, 31, 32, 63], 2)) == [0, 31, 32, 63]
    assert stop_only_row([31], 1).item() == -(1 << 31)


def test_padded_vocab_rows_have_no_bits_past_the_vocabulary(tokenizer, allowed_ids):
    from specd.grammar.compiler import GrammarCompilerCache

    cache = GrammarCompilerCache(tokenizer, 600, eos_token_ids=[1, 3])
    g = SequenceGrammar(cache.compile(GrammarSpec("regex", '"[^"]*"')))
    g.commit(tokenizer.encode('"ab', add_special_tokens=False))
    assert max(allowed_ids(g.next_mask())) < 512  # not 600..607, which xgrammar itself leaves set


def test_a_dead_end_of_the_grammar_lets_eos_end_the_output(cache, tokenizer, allowed_ids):
    """Regex a[^\\s\\S] allows "a" and then nothing: rows never go all-zero, EOS terminates."""
    g = SequenceGrammar(cache.compile(GrammarSpec("regex", r"a[^\s\S]")))
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    result = g.mask_along([a, 1])
    assert result.num_valid_drafts == 1 and allowed_ids(result.bitmask[1]) == [1, 3]
    d = g.fork_drafts()
    assert d.advance(a) and d.advance(3) and d.is_terminated() and not d.advance(3)
    d.reset()
    assert not d.is_terminated() and not g.is_terminated()
    with pytest.raises(GrammarViolation):
        g.commit([a, 1, 3])  # all or nothing: the dead-end stop is undone too
    assert g.num_committed == 0 and not g.is_terminated()
    g.commit([a, 1])
    assert g.is_terminated() and allowed_ids(g.next_mask()) == [1, 3]
    assert g.fork_drafts().is_terminated()
