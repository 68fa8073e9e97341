"""Budget-aware closing in SequenceGrammar.mask_along (specd/grammar/budget.py), real xgrammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from specd.grammar.backend import GrammarSpec
from specd.grammar.budget import ClosingConfig, ClosingPath
from specd.grammar.closing import closing_suffix
from specd.grammar.masking import bitmask_to_bool

from tests.grammar.conftest import EOS_IDS

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "object", "properties": {"key": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["key", "n"]}}}, "required": ["name", "tags"]}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))


def grammar(cache, text: str = "", tokenizer=None, **kwargs):
    g = cache.sequence_grammar(SPEC)
    if kwargs:
        from specd.grammar.matcher import SequenceGrammar

        g = SequenceGrammar(cache.compile(SPEC), cache.allowed_rows(SPEC.kind), closing_preference=cache.closing_preference,
                            **kwargs)
    if text:
        g.commit(tokenizer.encode(text, add_special_tokens=False))
    return g


def suffix_of(cache, g) -> list[int]:
    return closing_suffix(g.fork_drafts(), cache.closing_preference(), 128)


def one_hot(row: torch.Tensor, vocab: int) -> int | None:
    allowed = bitmask_to_bool(row[None], vocab)[0].nonzero().flatten().tolist()
    return allowed[0] if len(allowed) == 1 else None


def test_an_ample_budget_leaves_the_rows_unchanged(cache, tokenizer):
    g = grammar(cache, '{"name": "ab', tokenizer)
    drafts = tokenizer.encode('cd", "tags": [{"key"', add_special_tokens=False)
    plain = g.mask_along(drafts)
    for budget in (None, 10_000, ClosingConfig().horizon + len(drafts) + 1):
        got = g.mask_along(drafts, budget)
        assert torch.equal(got.bitmask, plain.bitmask) and got.num_valid_drafts == plain.num_valid_drafts
        assert got.num_closing_rows == 0
    assert g.closer.num_walks == 0  # rows far from the end cost nothing


@pytest.mark.parametrize("margin", [0, 4])
def test_rows_are_forced_exactly_when_the_suffix_needs_the_budget(cache, tokenizer, margin):
    g = grammar(cache, '{"name": "abc', tokenizer, closing=ClosingConfig(margin=margin))
    suffix = suffix_of(cache, g)
    plain = g.mask_along([]).bitmask[0]
    forced = g.mask_along([], len(suffix) + margin)
    assert forced.num_closing_rows == 1 and one_hot(forced.bitmask[0], 512) == suffix[0]
    free = g.mask_along([], len(suffix) + margin + 1)
    assert free.num_closing_rows == 0 and one_hot(free.bitmask[0], 512) is None
    allowed = bitmask_to_bool(free.bitmask, 512)[0]
    assert allowed[suffix[0]] and not (allowed & ~bitmask_to_bool(plain[None], 512)[0]).any()  # a subset


def test_following_the_forced_rows_ends_valid_within_the_budget(cache, tokenizer):
    """Decode greedily by the rows alone (always the lowest allowed id): the budget closes it."""
    shortest = len(suffix_of(cache, grammar(cache)))  # the shortest output the walk knows
    for budget in (shortest, shortest + 3, shortest + 20, shortest + 60):
        g = grammar(cache)
        out = []
        while not g.is_terminated():
            assert len(out) < budget, tokenizer.decode(out)
            row = g.mask_along([], budget - len(out)).bitmask[0]
            allowed = bitmask_to_bool(row[None], 512)[0]
            non_stop = allowed.clone()
            non_stop[EOS_IDS] = False
            out.append(int((non_stop if non_stop.any() else allowed).nonzero()[0]))  # never wants to stop
            g.commit(out[-1:])
        assert out[-1] in EOS_IDS and len(out) <= budget
        jsonschema.validate(json.loads(tokenizer.decode(out, skip_special_tokens=True)), SCHEMA)


def test_closing_follows_its_cached_path_without_walking_again(cache, tokenizer):
    g = grammar(cache, '{"name": "abc', tokenizer)
    suffix = suffix_of(cache, g)
    left = len(suffix)
    result = g.mask_along(suffix[:3], left)  # drafts along the suffix: every row forced
    assert result.num_valid_drafts == 3 and result.num_closing_rows == 4
    assert [one_hot(r, 512) for r in result.bitmask] == suffix[:4]
    walks = g.closer.num_walks
    for i, token in enumerate(suffix[:-1]):
        g.commit([token])
        assert one_hot(g.mask_along([], left - i - 1).bitmask[0], 512) == suffix[i + 1]
    assert g.closer.num_walks == walks  # the path answered every later step
    g.commit(suffix[-1:])
    assert g.is_terminated()


def test_rows_along_drafts_equal_rows_one_step_at_a_time(cache, tokenizer):
    """Speculation-lossless: row j of mask_along(drafts, b) is the row 0 that target-only decoding
    sees after committing drafts[:j] with budget b - j, whatever the drafts."""
    prefix = '{"name": "ab'
    base = grammar(cache, prefix, tokenizer)
    suffix = suffix_of(cache, base)
    other = tokenizer.encode('cd"', add_special_tokens=False)
    for drafts in (suffix[:4], other + suffix_of(cache, grammar(cache, prefix + 'cd"', tokenizer))[:3], other):
        for budget in (len(suffix) + 1, len(suffix) + 6, len(suffix) + 30):
            g = grammar(cache, prefix, tokenizer)
            got = g.mask_along(drafts, budget)
            for j in range(got.num_valid_drafts + 1):
                fresh = grammar(cache, prefix, tokenizer)
                fresh.commit(drafts[:j])
                want = fresh.mask_along([], budget - j)
                assert torch.equal(got.bitmask[j], want.bitmask[0]), (drafts, budget, j)


def test_a_token_that_cannot_close_in_time_is_taken_out(cache, tokenizer):
    """After an item, `,` starts another one of required fields: allowed with room, not without."""
    g = grammar(cache, '{"name": "", "tags": [{"key": "", "n": 1}', tokenizer)
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    suffix = suffix_of(cache, g)  # "]}" + stop
    g2 = grammar(cache, '{"name": "", "tags": [{"key": "", "n": 1},', tokenizer)
    needed = 1 + len(suffix_of(cache, g2))  # tokens to the end through ","
    assert needed > len(suffix) + ClosingConfig().margin + 1
    assert bitmask_to_bool(g.mask_along([]).bitmask, 512)[0, comma]
    for budget, allowed in ((needed - 1, False), (needed, True), (200, True)):
        row = g.mask_along([], budget).bitmask
        assert bool(bitmask_to_bool(row, 512)[0, comma]) == allowed, budget


def test_no_closing_when_nothing_fits_or_when_disabled(cache, tokenizer):
    g = grammar(cache, '{"name": "abc', tokenizer)
    suffix = suffix_of(cache, g)
    plain = g.mask_along([]).bitmask
    off = grammar(cache, '{"name": "abc', tokenizer, closing=None)
    assert torch.equal(off.mask_along([], 2).bitmask, plain)
    narrow = ClosingConfig(horizon=len(suffix) - 1, reserve=0, margin=0)
    tight = grammar(cache, '{"name": "abc', tokenizer, closing=narrow)
    assert torch.equal(tight.mask_along([], len(suffix) - 1).bitmask, plain)  # no suffix within the horizon
    with pytest.raises(ValueError, match="tokens_left"):
        g.mask_along([], 0)


def test_closing_config_is_validated():
    for kwargs, field in (({"horizon": 0}, "horizon"), ({"margin": -1}, "margin"), ({"margin": 200}, "margin"),
                          ({"reserve": 2, "margin": 4}, "reserve"), ({"max_checks": -1}, "max_checks")):
        with pytest.raises(ValueError, match=field):
            ClosingConfig(**kwargs)


def test_closing_path():
    path = ClosingPath((5, 6), (7, 8, 9))
    assert path.suffix_after([5, 6]) == (7, 8, 9) and path.suffix_after([5, 6, 7, 8]) == (9,)
    assert path.suffix_after([5]) is None and path.suffix_after([5, 6, 8]) is None
    assert path.suffix_after([5, 6, 7, 8, 9]) is None  # terminated: no suffix left
    assert path.after_commit([5]) == ClosingPath((6,), (7, 8, 9))
    assert path.after_commit([5, 6, 7]) == ClosingPath((), (8, 9))
    assert path.after_commit([4]) is None and path.after_commit([5, 6, 8]) is None
