"""LocalGrammarBackend: open (with replay), step (commits, then masks), close."""

from __future__ import annotations

import pytest
import torch

from specd.grammar.backend import GrammarBackend, GrammarSpec, GrammarStep
from specd.grammar.compiler import GrammarCompileError
from specd.grammar.errors import GrammarNotOpenError
from specd.grammar.local import LocalGrammarBackend
from specd.grammar.matcher import GrammarViolation, SequenceGrammar

REGEX = GrammarSpec("regex", "(abc|xyz)+")


def test_step_commits_then_masks_every_drafted_seq(cache, tokenizer):
    backend: GrammarBackend = LocalGrammarBackend(cache)
    ids = tokenizer.encode("abcxyzabc", add_special_tokens=False)
    backend.open(7, REGEX)
    backend.open(8, GrammarSpec("json_object"))
    out = backend.step(GrammarStep(commits={7: ids[:1]}, drafts={7: ids[1:3], 8: []}))
    assert set(out) == {7, 8}
    assert out[8].num_valid_drafts == 0 and out[8].bitmask.shape == (1, 16)  # empty drafts: row 0
    reference = SequenceGrammar(cache.compile(REGEX))
    reference.commit(ids[:1])
    assert torch.equal(out[7].bitmask, reference.mask_along(ids[1:3]).bitmask)
    # The drafts did not advance seq 7: the same request gives the same masks.
    again = backend.step(GrammarStep(drafts={7: ids[1:3]}))
    assert torch.equal(again[7].bitmask, out[7].bitmask)


def test_open_replays_accepted_tokens(cache, tokenizer):
    backend = LocalGrammarBackend(cache)
    ids = tokenizer.encode("abcxyz", add_special_tokens=False)
    backend.open(1, REGEX)
    backend.step(GrammarStep(commits={1: ids}))
    backend.open(2, REGEX, replay_token_ids=ids)  # a rebuilt matcher
    masks = backend.step(GrammarStep(drafts={1: [], 2: []}))
    assert torch.equal(masks[1].bitmask, masks[2].bitmask)
    assert backend.get(2).num_committed == len(ids)
    with pytest.raises(GrammarViolation):
        backend.open(3, REGEX, replay_token_ids=tokenizer.encode("q", add_special_tokens=False))
    assert 3 not in backend


def test_terminated_after_commit_is_reported(cache, tokenizer):
    backend = LocalGrammarBackend(cache)
    backend.open(1, REGEX)
    ids = tokenizer.encode("abc", add_special_tokens=False) + [1]
    result = backend.step(GrammarStep(commits={1: ids}, drafts={1: [5]}))[1]
    assert result.terminated and result.num_valid_drafts == 0


def test_close_unknown_and_errors(cache):
    backend = LocalGrammarBackend(cache)
    backend.open(1, REGEX)
    backend.close(1)
    backend.close(1)  # idempotent
    assert len(backend) == 0
    with pytest.raises(GrammarNotOpenError, match="sequence 1 has no open matcher"):
        backend.step(GrammarStep(drafts={1: []}))
    with pytest.raises(GrammarCompileError, match="invalid regex"):
        backend.open(2, GrammarSpec("regex", "(("))
