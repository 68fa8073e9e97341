"""The bitmask tensor functions on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from specd.grammar.masking import (apply_bitmask, apply_bitmask_, bitmask_to_bool, bitmask_width,
                                   translate_bitmask_to_draft_vocab)

NEG_INF = float("-inf")


def pack(allowed: list[list[int]], width: int) -> torch.Tensor:
    """Reference packing: rows of allowed ids -> [N, width] int32."""
    words = torch.zeros((len(allowed), width), dtype=torch.int64)
    for r, ids in enumerate(allowed):
        for i in ids:
            words[r, i // 32] |= 1 << (i % 32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


ROWS = [[0, 5, 31], [32, 40, 63]]
BITMASK = pack(ROWS, 2)  # [2, 2]: covers 64 ids


def expected_allowed(vocab: int) -> torch.Tensor:
    out = torch.zeros((2, vocab), dtype=torch.bool)
    for r, ids in enumerate(ROWS):
        out[r, [i for i in ids if i < vocab]] = True
    return out


@pytest.mark.parametrize("vocab", [40, 64, 70])  # narrower, equal, wider than 32 * W
def test_bitmask_to_bool(vocab):
    assert torch.equal(bitmask_to_bool(BITMASK, vocab), expected_allowed(vocab))


@pytest.mark.parametrize("vocab", [40, 64, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])  # 64: torch path
def test_apply_bitmask(vocab, dtype):
    logits = torch.randn(2, vocab).to(dtype)
    out = apply_bitmask(logits, BITMASK)
    allowed = expected_allowed(vocab)
    assert out.dtype == dtype and out.shape == logits.shape
    assert torch.equal(out[allowed], logits[allowed])
    assert torch.all(out[~allowed] == NEG_INF)
    assert not torch.isinf(logits).any()  # apply_bitmask copies


def test_apply_bitmask_in_place_on_a_row_view():
    logits = torch.zeros(4, 64)
    view = logits[1:3]
    assert apply_bitmask_(view, BITMASK) is view
    assert torch.all(logits[[0, 3]] == 0) and torch.equal(torch.isfinite(logits[1:3]), expected_allowed(64))


def test_apply_bitmask_checks_shapes():
    with pytest.raises(ValueError, match="logits"):
        apply_bitmask(torch.zeros(3, 64), BITMASK)
    with pytest.raises(ValueError, match="bitmask"):
        apply_bitmask(torch.zeros(2, 64), BITMASK.to(torch.int64))


def test_translate_to_draft_vocab():
    # Draft vocab of 4 ids -> target ids 0, 5, 32, 63; d2t[i] = target - i.
    d2t = torch.tensor([0, 4, 30, 60], dtype=torch.int64)
    expected = torch.tensor([[True, True, False, False], [False, False, True, True]])
    assert torch.equal(translate_bitmask_to_draft_vocab(BITMASK, d2t), expected)
    assert torch.equal(translate_bitmask_to_draft_vocab(bitmask_to_bool(BITMASK, 64), d2t), expected)


def test_translate_target_ids_outside_the_vocabulary_are_forbidden():
    d2t = torch.tensor([0, 100, -5, 40], dtype=torch.int64)  # targets 0, 101, -3, 43
    expected = torch.tensor([[True, False, False, False], [False, False, False, False]])
    assert torch.equal(translate_bitmask_to_draft_vocab(BITMASK, d2t), expected)
    assert torch.equal(translate_bitmask_to_draft_vocab(bitmask_to_bool(BITMASK, 64), d2t), expected)


def test_translate_matches_the_tiny_eagle3_head(tiny_models, cache, tokenizer):
    """The real d2t of the tiny EAGLE-3 head against an element-wise lookup."""
    from safetensors.torch import load_file

    from specd.grammar.backend import GrammarSpec
    from specd.grammar.matcher import SequenceGrammar

    tensors = load_file(str(next(tiny_models["draft-eagle3"].glob("*.safetensors"))))
    d2t = tensors["d2t"]
    g = SequenceGrammar(cache.compile(GrammarSpec("regex", '"[a-z ]*"')))
    g.commit(tokenizer.encode('"ab', add_special_tokens=False))
    row = g.next_mask()[None]
    allowed = bitmask_to_bool(row, 512)[0]
    expected = torch.tensor([bool(allowed[i + int(d2t[i])]) for i in range(d2t.shape[0])])
    assert torch.equal(translate_bitmask_to_draft_vocab(row, d2t)[0], expected)


def test_bitmask_width():
    assert [bitmask_width(v) for v in (1, 32, 33, 512)] == [1, 1, 2, 16]
