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


class AcceptanceEstimate:
    """Decayed evidence of one request's verify steps, per draft position (max_depth of them)."""

    __slots__ = ("prior", "_tried", "_kept")

    def __init__(self, max_depth: int, prior: AcceptancePrior) -> None:
        self.prior = prior
        self._tried = [0.0] * max_depth  # decayed steps in which draft j was verified
        self._kept = [0.0] * max_depth  # of them, decayed steps that kept it

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One verify step of the request: num_drafted drafts verified (0: a plain decode step,
        which only decays the evidence), the first num_accepted of them kept."""
        decay = self.prior.decay if num_drafted else self.prior.idle_decay
        tried, kept = self._tried, self._kept
        if decay < 1.0:
            for j in range(len(tried)):
                tried[j] *= decay
                kept[j] *= decay
        # Drafts 0..m were tested (m the first rejected, when any); 0..m-1 kept.
        for j in range(min(num_accepted + 1, num_drafted, len(tried))):
            tried[j] += 1.0
        for j in range(min(num_accepted, len(kept))):
            kept[j] += 1.0

    def conditional(self) -> list[float]:
        """p_j for j = 0..max_depth-1: draft j accepted given the drafts before it were."""
        a, s = self.prior.mean * self.prior.strength, self.prior.strength
        return [(a + k) / (s + t) for k, t in zip(self._kept, self._tried)]

    def cumulative(self) -> list[float]:
        """c_j = p_0 * ... * p_j: the chance that the first j+1 drafts are all kept, i.e. the
        expected tokens draft j adds; E[accepted | k] = c_0 + ... + c_{k-1}."""
        out, c = [], 1.0
        for p in self.conditional():
            c *= p
            out.append(c)
        return out
