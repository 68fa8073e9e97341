"""greedy_proposals (specd/proposers/base.py): the lookup drafters' proposals as views of one tensor."""

from __future__ import annotations

import torch

from specd.proposers.base import greedy_proposals


def test_each_list_becomes_its_own_one_hot_proposal():
    drafts = [[5, 6, 7], [], [9], [1, 2, 3, 4]]
    proposals = greedy_proposals(drafts)
    assert [p.token_ids.tolist() for p in proposals] == drafts
    assert all(p.token_ids.dtype == torch.long and p.token_ids.ndim == 1 and p.probs is None for p in proposals)
    assert proposals[3].truncated(2).token_ids.tolist() == [1, 2]
    # one allocation for the batch, not one per sequence
    storages = {p.token_ids.untyped_storage().data_ptr() for p in proposals}
    assert len(storages) == 1


def test_no_lists_one_list_and_only_empty_lists():
    assert greedy_proposals([]) == []
    (one,) = greedy_proposals([[3, 4]])
    assert one.token_ids.tolist() == [3, 4] and one.token_ids.dtype == torch.long
    proposals = greedy_proposals([[], []])
    assert [p.token_ids.numel() for p in proposals] == [0, 0]
