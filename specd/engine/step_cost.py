"""What one engine step costs, in seconds, as a function of what the draft-length chooser decides.

step(T, d) = other + verify(T) + draft(d)
  T: the verify batch's query tokens, sum over sequences of 1 + k_i;
  d: the draft depth, max k_i (a chain drafter runs d forwards; d = 0 still ingests);
  verify(T): the verify forward and sampling, to the commit's sync;
  draft(d): the engine's wait for drafts (what drafting ahead does not hide);
  other: the rest of the step (admission's host work, commit), prefills excluded.

Measured, not per device: each step's times update an exponential moving average, verify per
half-octave bucket of T (piecewise-linear between buckets), draft per depth, other as one value;
a sample above CLIP times its average counts as CLIP times (a CUDA-graph capture or a GC pause is
not the step's cost). Before any measurement the model has a default shape in units of a
one-token verify (flat-ish verify, drafting a fraction of it per depth); shapes it has not
measured are extrapolated from what it has, scaled by the default's slopes.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

CLIP = 4.0  # a sample counts at most this many times its running average


class StepCostModel:
    """Seconds of a step at T query tokens and draft depth d (see the module doc)."""

    def __init__(self, max_depth: int, *, smoothing: float = 0.2, token_slope: float = 1 / 512,
                 depth_share: float = 0.05) -> None:
        """smoothing: the EMA's weight of a new sample; token_slope: the default verify cost of
        one more query token, as a share of a one-token verify (memory-bound forwards are flat
        for hundreds of tokens); depth_share: the default draft cost of one more depth, as a
        share of a one-token verify."""
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing: must be in (0, 1], got {smoothing}")
        self.max_depth = max_depth
        self.smoothing = smoothing
        self.token_slope = token_slope
        self.depth_share = depth_share
        self.reset()

    def reset(self) -> None:
        """Forget every measurement (after warm-up's one-time costs, for instance)."""
        self._verify: dict[int, list[float]] = {}  # bucket -> [mean T, mean seconds]
        self._draft: list[float | None] = [None] * (self.max_depth + 1)  # depth -> mean seconds
        self._other: float | None = None
        self.num_observed = 0
        self._points: tuple[np.ndarray, np.ndarray] | None = None  # _verify_points, until the next sample
        self._point_lists: tuple[list[float], list[float]] = ([], [])  # the same as lists
        self._drafts: list[float] | None = None  # _draft_table, until the next sample

    # ---- measurements ---------------------------------------------------------------------
    def observe(self, num_tokens: int, depth: int, *, verify_s: float, draft_s: float,
                other_s: float) -> None:
        """One step's measured seconds at T = num_tokens and draft depth `depth`."""
        if num_tokens < 1:
            return
        bucket = round(2 * math.log2(num_tokens))
        point = self._verify.get(bucket)
        if point is None:
            self._verify[bucket] = [float(num_tokens), verify_s]
        else:
            point[0] = self._ema(point[0], float(num_tokens))
            point[1] = self._ema(point[1], verify_s)
        depth = min(max(depth, 0), self.max_depth)
        self._draft[depth] = draft_s if self._draft[depth] is None else self._ema(self._draft[depth], draft_s)
        self._other = other_s if self._other is None else self._ema(self._other, other_s)
        self.num_observed += 1
        self._points = self._drafts = None

    def _ema(self, mean: float, sample: float) -> float:
        sample = min(sample, CLIP * mean) if mean > 0 else sample
        return mean + self.smoothing * (sample - mean)

    # ---- predictions ------------------------------------------------------------------------
    def step_seconds(self, num_tokens: np.ndarray, depth: int) -> np.ndarray:
        """Predicted seconds (units of a one-token verify before any measurement) of a step at
        each T of num_tokens, all at draft depth `depth`."""
        drafts = self._draft_table()
        draft = drafts[depth] if 0 <= depth < len(drafts) else self.draft_seconds(depth)
        return (self._other or 0.0) + self.verify_seconds(num_tokens) + draft

    def step_seconds_one(self, num_tokens: float, depth: int) -> float:
        """step_seconds of one plan, in plain floats (no array work: batch 1 asks it every step)."""
        drafts = self._draft_table()
        draft = drafts[depth] if 0 <= depth < len(drafts) else self.draft_seconds(depth)
        return (self._other or 0.0) + self._verify_one(float(num_tokens)) + draft

    def _verify_one(self, t: float) -> float:
        """verify_seconds of one T, the same rule in plain floats."""
        self._verify_points()
        xs, ys = self._point_lists
        if len(xs) == 0:
            return 1.0 + self.token_slope * t
        if len(xs) == 1:
            return ys[0] * (1.0 + self.token_slope * t) / (1.0 + self.token_slope * xs[0])
        if t < xs[0]:
            lo = max(0.0, (ys[1] - ys[0]) / max(xs[1] - xs[0], 1e-9))
            return max(0.0, ys[0] - lo * (xs[0] - t))
        if t > xs[-1]:
            hi = max(0.0, (ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-9))
            return max(0.0, ys[-1] + hi * (t - xs[-1]))
        i = min(bisect.bisect_right(xs, t), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 if x1 == x0 else y0 + (y1 - y0) * (t - x0) / (x1 - x0))

    def _verify_points(self) -> tuple[np.ndarray, np.ndarray]:
        """The verify points as arrays, sorted by T (made once per measurement: the chooser asks
        several times a step)."""
        if self._points is None:
            points = sorted(self._verify.values())
            self._points = (np.array([p[0] for p in points]), np.array([p[1] for p in points]))
            self._point_lists = ([p[0] for p in points], [p[1] for p in points])
        return self._points

    def _draft_table(self) -> list[float]:
        """draft_seconds of every depth up to max_depth (made once per measurement)."""
        if self._drafts is None:
            per_depth = self._default_per_depth()
            self._drafts = [self.draft_seconds(d, per_depth) for d in range(self.max_depth + 1)]
        return self._drafts

    def _default_per_depth(self) -> float:
        return self.depth_share * self._verify_one(1.0)

    def verify_seconds(self, num_tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(num_tokens, dtype=np.float64)
        xs, ys = self._verify_points()
        if len(xs) == 0:
            return 1.0 + self.token_slope * t
        if len(xs) == 1:  # the default shape through the one measured point
            t0, v0 = xs[0], ys[0]
            return v0 * (1.0 + self.token_slope * t) / (1.0 + self.token_slope * t0)
        inside = np.interp(t, xs, ys)
        # Outside the measured range, the nearest segment's slope (never negative: noise).
        lo = max(0.0, (ys[1] - ys[0]) / max(xs[1] - xs[0], 1e-9))
        hi = max(0.0, (ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-9))
        out = np.where(t < xs[0], ys[0] - lo * (xs[0] - t), inside)
        return np.maximum(np.where(t > xs[-1], ys[-1] + hi * (t - xs[-1]), out), 0.0)

    def draft_seconds(self, depth: int, per_depth: float | None = None) -> float:
        """per_depth: the default's cost of one more depth (computed when not given)."""
        measured = [(d, s) for d, s in enumerate(self._draft) if s is not None]
        per_depth = self._default_per_depth() if per_depth is None else per_depth
        if not measured:
            return per_depth * depth
        below = [(d, s) for d, s in measured if d <= depth]
        above = [(d, s) for d, s in measured if d >= depth]
        if below and above:
            (d0, s0), (d1, s1) = below[-1], above[0]
            return s0 if d1 == d0 else s0 + (s1 - s0) * (depth - d0) / (d1 - d0)
        if above:  # below every measured depth: the default slope down from the lowest
            d1, s1 = above[0]
            return max(0.0, s1 - per_depth * (d1 - depth))
        d0, s0 = below[-1]  # past every measured depth: the last segment's slope, else the default's
        if len(measured) >= 2:
            (da, sa), (db, sb) = measured[-2], measured[-1]
            per_depth = max(0.0, (sb - sa) / (db - da))
        return s0 + per_depth * (depth - d0)
