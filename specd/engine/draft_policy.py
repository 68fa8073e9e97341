"""How many drafts each sequence gets in a step: the engine's side of adaptive drafting.

The engine plans each step's caps (budget, cache room: drafting.plan_draft_lengths, the most
`num_speculative_tokens` allows) and hands them here. With adaptation on, the policy keeps an
acceptance estimate per request (acceptance_estimate.py) and a step cost model for the
deployment (step_cost.py, fed every step's measured times), and picks the k_i that maximise the
batch's expected tokens per second (draft_lengths.py); k = 0 for everyone when nothing pays.
Off, the caps are the ks: fixed k, as without it.

Every PROBE_EVERY steps a sequence at k = 0 drafts one token anyway, so that a request whose
drafts once missed (or a deployment whose costs changed) is measured again; its estimate also
decays toward the method's prior meanwhile.

Lossless whatever it picks: k comes from committed verdicts and timings, never from the drafts
about to be verified (rejection sampling is exact for any k).
"""

from __future__ import annotations

from specd.engine.acceptance_estimate import AcceptanceEstimates, AcceptancePrior
from specd.engine.draft_lengths import choose_draft_lengths
from specd.engine.stats import StepTimings
from specd.engine.step_cost import StepCostModel

PROBE_EVERY = 16  # steps between forced one-draft probes of sequences at k = 0


class DraftLengthPolicy:
    """Per-sequence draft lengths for an engine (see the module doc)."""

    def __init__(self, max_depth: int, *, adaptive: bool = True, method: str | None = None,
                 prior: AcceptancePrior | None = None, cost: StepCostModel | None = None,
                 probe_every: int = PROBE_EVERY, margin: float = 0.0, measure_costs: bool = True) -> None:
        """max_depth: num_speculative_tokens, the most any sequence drafts; method: picks the
        acceptance prior (AcceptancePrior.for_method) unless `prior` is given; cost: the step cost
        model (tests inject one; by default measured from this engine's steps); probe_every: 0
        never probes; margin: drafting must beat k = 0's predicted rate by this share;
        measure_costs: False keeps the cost model at its default shape (tensor-parallel ranks: each
        rank's clock differs, and every rank must choose the same k for their collectives to match)."""
        if probe_every < 0:
            raise ValueError(f"probe_every: must be >= 0, got {probe_every}")
        self.max_depth = max_depth
        self.adaptive = adaptive and max_depth > 0
        self.prior = prior or AcceptancePrior.for_method(method)
        self.cost = cost if cost is not None else StepCostModel(max_depth)
        self.probe_every = probe_every
        self.margin = margin
        self.measure_costs = measure_costs
        self.forced_k: int | None = None  # warm-up: every sequence drafts min(forced_k, its cap)
        self._estimates = AcceptanceEstimates(max_depth, self.prior)
        self._step = 0  # verify steps seen (probes fall on multiples of probe_every)
        self._drafted = (0, 0)  # the step's verify batch: query tokens T, draft depth d

    def plan(self, caps: dict[int, int]) -> dict[int, int]:
        """k per sequence id of the step's batch, each within its cap (caps: id -> the most it may
        draft, budget and cache room considered)."""
        if self.forced_k is not None:
            return {i: min(self.forced_k, cap) for i, cap in caps.items()}
        if not self.adaptive or not any(caps.values()):
            return dict(caps)
        if len(self._estimates) > len(caps):  # requests gone (finished, aborted, preempted): forgotten
            self._estimates.keep_only(caps)
        ids, limits = list(caps), list(caps.values())
        if len(ids) == 1:  # batch 1, every step: each k scored in plain floats
            ks = [self._best_alone(self._estimates.cumulative(ids)[0].tolist(), limits[0])]
        else:
            ks = choose_draft_lengths(self._estimates.cumulative(ids), limits, self.cost.step_seconds,
                                      margin=self.margin)
        if self.probe_every and self._step % self.probe_every == self.probe_every - 1:
            ks = [k if k or not cap else 1 for k, cap in zip(ks, limits)]
        return dict(zip(ids, ks))

    def restart_probes(self) -> None:
        """Count steps to the next probe from now (warm-up's steps do not shift served ones)."""
        self._step = 0

    def observe_verdicts(self, seq_ids: list[int], num_drafted: list[int], num_accepted: list[int]) -> None:
        """A verify step's sequences: num_drafted[i] drafts verified (0 too), num_accepted[i] kept."""
        if self.adaptive and seq_ids:
            self._estimates.observe(seq_ids, num_drafted, num_accepted)

    def drafted(self, num_tokens: int, depth: int) -> None:
        """The step's verify batch: T = num_tokens query tokens, at draft depth `depth` (max k)."""
        self._drafted = (num_tokens, depth)

    def observe_timings(self, step: StepTimings, seconds: float) -> None:
        """A verify step's measured verbs (`step`, the step's own StepTimings) and its `seconds`,
        at the T and depth `drafted` named: verify to the commit's device sync; prefills aside
        (they do not depend on k)."""
        self._step += 1
        if self.adaptive and self.measure_costs:
            verify = step.verify + step.device_wait
            other = max(0.0, seconds - step.draft - verify - step.prefill)
            self.cost.observe(*self._drafted, verify_s=verify, draft_s=step.draft, other_s=other)

    def _best_alone(self, cumulative: list[float], cap: int) -> int:
        """choose_draft_lengths for one sequence: the k in [0, cap] of the best expected rate (k = 0
        favoured by the margin; the smallest k on a tie)."""
        best_k, tokens = 0, 1.0
        best_rate = tokens / self.cost.step_seconds_one(1.0, 0) * (1.0 + self.margin)
        for k in range(1, min(cap, len(cumulative)) + 1):
            tokens += cumulative[k - 1]
            rate = tokens / self.cost.step_seconds_one(1.0 + k, k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k
