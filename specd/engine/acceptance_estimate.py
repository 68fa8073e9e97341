"""One request's acceptance, per draft position, as the draft-length chooser needs it.

p_j = P(draft j accepted | drafts 0..j-1 accepted), j = 0..K-1: a Beta-style estimate per
position, (prior_mean * strength + kept_j) / (strength + tried_j), where draft j was tried in a
step when every draft before it was kept. Evidence decays by `decay` per drafting step of the
request (acceptance drifts along a text) and by the slower `idle_decay` per step without drafts:
an estimate that drove k to 0 drifts back toward the prior, so a request whose drafts missed
gets drafted (re-probed) again later, less often the longer its record. The prior is per method.

Only verdicts already committed feed it: k chosen from it never depends on a draft's content.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Conditional acceptance per position before a request has shown its own: what the methods
# typically reach on chat text; a wrong prior costs a few steps, the evidence takes over.
METHOD_PRIOR_MEANS = {"eagle3": 0.7, "deepseek_mtp": 0.8, "qwen3_5_mtp": 0.8, "draft_model": 0.7,
                      "ngram": 0.5, "replay": 0.9}
DEFAULT_PRIOR_MEAN = 0.7


@dataclass(frozen=True)
class AcceptancePrior:
    """mean: p_j before any evidence (every position); strength: the pseudo-observations it
    weighs against the request's own; decay, idle_decay: evidence kept per verify step with
    drafts, without (each in (0, 1])."""

    mean: float = DEFAULT_PRIOR_MEAN
    strength: float = 2.0
    decay: float = 0.95
    idle_decay: float = 0.99

    def __post_init__(self) -> None:
        if not 0.0 < self.mean < 1.0:
            raise ValueError(f"mean: must be in (0, 1), got {self.mean}")
        if self.strength <= 0.0:
            raise ValueError(f"strength: must be > 0, got {self.strength}")
        for name in ("decay", "idle_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must be in (0, 1], got {getattr(self, name)}")

    @classmethod
    def for_method(cls, method: str | None, **kwargs) -> "AcceptancePrior":
        return cls(mean=METHOD_PRIOR_MEANS.get(method or "", DEFAULT_PRIOR_MEAN), **kwargs)


class AcceptanceEstimates:
    """Decayed evidence of the running requests' verify steps, per draft position (max_depth of
    them): one row a request, updated and read for a whole batch at once (it runs every step)."""

    def __init__(self, max_depth: int, prior: AcceptancePrior) -> None:
        self.prior = prior
        self.max_depth = max_depth
        self._rows: dict[int, int] = {}  # request -> row
        self._free: list[int] = []
        self._tried = np.zeros((0, max_depth))  # decayed steps in which draft j was verified
        self._kept = np.zeros((0, max_depth))  # of them, decayed steps that kept it

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self, seq_ids) -> np.ndarray:
        """The rows of these requests; a request seen first gets a fresh row (the prior alone)."""
        out = []
        for seq_id in seq_ids:
            row = self._rows.get(seq_id)
            if row is None:
                row = self._rows[seq_id] = self._new_row()
            out.append(row)
        return np.asarray(out, dtype=np.int64)

    def keep_only(self, seq_ids) -> None:
        """Forget every request not among seq_ids (finished, aborted, preempted)."""
        keep = set(seq_ids)
        for seq_id in [i for i in self._rows if i not in keep]:
            self._free.append(self._rows.pop(seq_id))

    def observe(self, seq_ids, num_drafted, num_accepted) -> None:
        """One verify step of each request: num_drafted[i] drafts verified (0: a plain decode step,
        which only decays the evidence), the first num_accepted[i] of them kept."""
        rows = self.rows(seq_ids)
        drafted = np.asarray(num_drafted, dtype=np.int64)
        accepted = np.asarray(num_accepted, dtype=np.int64)
        decay = np.where(drafted > 0, self.prior.decay, self.prior.idle_decay)[:, None]
        positions = np.arange(self.max_depth)[None, :]
        # Drafts 0..m were tested (m the first rejected, when any); 0..m-1 kept.
        tried = positions < np.minimum(accepted + 1, drafted)[:, None]
        kept = positions < accepted[:, None]
        self._tried[rows] = self._tried[rows] * decay + tried
        self._kept[rows] = self._kept[rows] * decay + kept

    def conditional(self, seq_ids) -> np.ndarray:
        """[n, max_depth] p_j: draft j accepted given the drafts before it were."""
        rows = self.rows(seq_ids)
        a, s = self.prior.mean * self.prior.strength, self.prior.strength
        return (a + self._kept[rows]) / (s + self._tried[rows])

    def cumulative(self, seq_ids) -> np.ndarray:
        """[n, max_depth] c_j = p_0 * ... * p_j: the chance that the first j+1 drafts are all
        kept, i.e. the expected tokens draft j adds; E[accepted | k] = c_0 + ... + c_{k-1}."""
        return np.cumprod(self.conditional(seq_ids), axis=1)

    def _new_row(self) -> int:
        if self._free:
            row = self._free.pop()
        else:
            row = len(self._tried)
            grown = max(8, 2 * row)
            self._tried = np.resize(self._tried, (grown, self.max_depth))
            self._kept = np.resize(self._kept, (grown, self.max_depth))
            self._free.extend(range(grown - 1, row, -1))
        self._tried[row] = 0.0
        self._kept[row] = 0.0
        return row
