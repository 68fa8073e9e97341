"""Speculative-decoding Prometheus metrics, shared by the gateway and the verifier.

Names follow lmdeploy's and vLLM's spec_decode_* counters (with the specd: prefix): drafts (verify
steps that checked at least one draft token), draft tokens, accepted tokens, accepted tokens per
draft position; the gauges are running means over everything observed: acceptance rate = accepted /
drafted, acceptance length = 1 + accepted / drafts (the bonus or recovered token counted).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from specd.messages import SpecStats


class SpecDecodeMetrics:
    """Counters and gauges of speculation, fed SpecStats increments."""

    def __init__(self, registry: CollectorRegistry, labelnames: tuple[str, ...] = (),
                 labelvalues: tuple[str, ...] = ()) -> None:
        labels = list(labelnames)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=registry)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels + list(extra), registry=registry)

        self._values = tuple(labelvalues)
        self.num_drafts = counter("specd:spec_decode_num_drafts",
                                  "Verify steps that checked at least one draft token.")
        self.num_draft_tokens = counter("specd:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("specd:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.num_accepted_tokens_per_pos = counter("specd:spec_decode_num_accepted_tokens_per_pos",
                                                   "Draft tokens accepted at each draft position.", ("position",))
        self.mean_acceptance_rate = gauge("specd:spec_decode_mean_acceptance_rate",
                                          "Accepted / drafted tokens over everything observed.")
        self.mean_acceptance_length = gauge("specd:spec_decode_mean_acceptance_length",
                                            "Tokens emitted per verify step (accepted + 1, bonus counted).")
        self.per_position_acceptance_rate = gauge("specd:spec_decode_per_position_acceptance_rate",
                                                  "Accepted at each draft position / drafts.", ("position",))
        self.totals = SpecStats()

    def _child(self, metric, *extra: str):
        values = self._values + extra
        return metric.labels(*values) if values else metric

    def observe(self, stats: SpecStats) -> None:
        """Add an increment (a finished request's stats, or one step's)."""
        if stats.num_drafts <= 0:
            return
        c = self._child
        c(self.num_drafts).inc(stats.num_drafts)
        c(self.num_draft_tokens).inc(stats.num_draft_tokens)
        c(self.num_accepted_tokens).inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            c(self.num_accepted_tokens_per_pos, str(position)).inc(count)
        self.totals.merge(stats)
        c(self.mean_acceptance_rate).set(self.totals.acceptance_rate)
        c(self.mean_acceptance_length).set(self.totals.mean_acceptance_length)
        for position, count in enumerate(self.totals.accepted_per_position):
            c(self.per_position_acceptance_rate, str(position)).set(count / self.totals.num_drafts)
