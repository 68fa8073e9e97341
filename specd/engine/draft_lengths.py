"""Choose each sequence's draft length for one step: the k_i that pay for the whole batch.

Maximise  rate(k) = sum_i (1 + E[accepted_i | k_i]) / step(sum_i (1 + k_i), max_i k_i)
over k_i in [0, cap_i], with E[accepted_i | k] = c_i0 + ... + c_i,k-1 (acceptance_estimate.py:
c_ij the chance that sequence i's first j+1 drafts are all kept) and step(T, d) the step's
predicted seconds (step_cost.py).

c_ij never grows with j, so for a given draft depth d and a given number of drafts n, the best
plan takes the n largest c_ij with j < d: those are prefixes per sequence. The chooser sorts the
c_ij once and, for each depth d, scores every prefix of the sorted gains at once (numpy), keeping
the best; k = 0 everywhere unless some plan beats it. O(K * B*K) numpy work, one sort, and no
Python loop over the batch (it runs every step).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

StepCost = Callable[[np.ndarray, int], np.ndarray]  # (T per candidate plan, depth d) -> seconds


def choose_draft_lengths(cumulative, caps, step_cost: StepCost, *, margin: float = 0.0) -> list[int]:
    """k_i per sequence. cumulative: [B, K], cumulative[i][j] = c_ij (non-increasing in j);
    caps[i]: the most k_i may be (budget, cache room; at most K); step_cost: predicted seconds of
    steps at T query tokens and draft depth d; margin: a drafting plan must beat k = 0's rate by
    this share (0: any gain)."""
    batch = len(caps)
    if batch == 0:
        return []
    c = np.asarray(cumulative, dtype=np.float64).reshape(batch, -1)
    positions = np.arange(c.shape[1])
    taken = positions[None, :] < np.asarray(caps)[:, None]  # [B, K]: the gains a plan may take
    if not taken.any():
        return [0] * batch
    gains, seqs, depths = c[taken], np.nonzero(taken)[0], np.broadcast_to(positions, c.shape)[taken]
    # Largest gain first; within a sequence equal gains keep their position order (a prefix).
    order = np.lexsort((depths, -gains))
    g, s, j = gains[order], seqs[order], depths[order]
    best_rate = batch / float(step_cost(np.array([batch], dtype=np.float64), 0)[0]) * (1.0 + margin)
    best: tuple[int, int] | None = None  # (depth, drafts taken)
    for d in range(1, int(j.max()) + 2):
        take = j < d
        cum = np.cumsum(g[take])
        tokens = batch + np.arange(1, cum.size + 1, dtype=np.float64)
        # A plan at depth d must reach it: it takes at least up to the first draft at depth d - 1.
        first_deep = int(np.argmax(j[take] == d - 1))
        rates = (batch + cum) / step_cost(tokens, d)
        rates[:first_deep] = -np.inf
        n = int(np.argmax(rates))
        if rates[n] > best_rate:
            best_rate, best = float(rates[n]), (d, n + 1)
    if best is None:
        return [0] * batch
    d, n = best
    return np.bincount(s[j < d][:n], minlength=batch).tolist()

