"""Prompt lookup: matching, limits, and the proposer's per-sequence state."""

import numpy as np
import torch

from specd.proposers.base import DraftRequest
from specd.proposers.ngram import NgramIndex, NgramProposer, find_ngram_continuation
from specd.sampling_params import SamplingParams


def test_longest_suffix_most_recent_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    # suffix [2, 3] occurs at 1 and 5; [5, 2, 3] never earlier; most recent match of [2, 3] -> 7
    assert find_ngram_continuation(tokens, 1, 3, 3).tolist() == [7, 5, 2]


def test_no_match_and_min_length():
    assert find_ngram_continuation(np.array([1, 2, 3]), 1, 4, 3).size == 0
    # [3] recurs but min_n=2 demands [2, 3]
    assert find_ngram_continuation(np.array([3, 1, 2, 3]), 2, 4, 3).size == 0


def test_continuation_is_cut_at_the_end():
    assert find_ngram_continuation(np.array([4, 5, 4]), 1, 2, 5).tolist() == [5, 4]


def test_proposer_accumulates_committed_tokens():
    prop = NgramProposer(1, 3)
    prop.open(0, SamplingParams())
    out = prop.propose([DraftRequest(0, [8, 9, 10, 8], None, 2)])[0]
    assert out.token_ids.tolist() == [9, 10] and out.probs is None
    out = prop.propose([DraftRequest(0, [9], None, 3)])[0]  # history 8 9 10 8 9 -> suffix [8, 9]
    assert out.token_ids.tolist() == [10, 8, 9]
    assert prop.propose([DraftRequest(0, [1], None, 0)])[0].token_ids.numel() == 0
    prop.close(0)
    assert 0 not in prop._indexes
    assert out.token_ids.dtype == torch.long


def test_index_answers_as_the_scan_after_every_extension():
    """NgramIndex (what the proposer keeps) against find_ngram_continuation (the definition), on
    random histories over small vocabularies (many repeats), grown in random chunks."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        vocab = int(rng.integers(2, 9))
        index = NgramIndex(min_n, max_n)
        history: list[int] = []
        while len(history) < 120:
            chunk = rng.integers(0, vocab, size=int(rng.integers(1, 6))).tolist()
            history += chunk
            index.extend(chunk)
            for k in (1, 3, 7):
                expected = find_ngram_continuation(np.array(history), min_n, max_n, k).tolist()
                assert index.continuation(k) == expected, (trial, history, min_n, max_n, k)
    assert index.tokens == history


def test_index_of_an_empty_or_short_history_has_nothing():
    index = NgramIndex(1, 4)
    assert index.continuation(3) == []
    index.extend([5])
    assert index.continuation(3) == []  # the suffix is no match for itself
    index.extend([5])
    assert index.continuation(3) == [5]
