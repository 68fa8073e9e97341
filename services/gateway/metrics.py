"""The gateway's Prometheus metrics, on its own registry (never the global one).

Speculation metrics (specd/spec_metrics.py) are computed from each finished request's
spec_stats, so they agree with the per-request figures by construction.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specd.messages import SpecStats
from specd.spec_metrics import SpecDecodeMetrics

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class GatewayMetrics:
    """Counters, gauges and histograms of one gateway, labelled with the served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        self.spec = SpecDecodeMetrics(r, ("model_name",), (model_name,))
        self.requests = counter("specd:request_success_total", "Finished requests by finish reason.",
                                ("finished_reason",))
        self.request_errors = counter("specd:request_failure_total",
                                      "Failed requests by HTTP-like status (validation, queue full, timeout, "
                                      "verifier error, client gone).", ("status",))
        self.prompt_tokens = counter("specd:prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("specd:generation_tokens_total", "Generated tokens of finished requests.")
        self.time_to_first_token = Histogram("specd:time_to_first_token_seconds",
                                             "Time from the gateway's receipt to the first token.", labels,
                                             buckets=TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("specd:time_per_output_token_seconds",
                                               "Time per output token after the first.", labels,
                                               buckets=TPOT_BUCKETS, registry=r)
        self.e2e_latency = Histogram("specd:e2e_request_latency_seconds", "End-to-end request latency.",
                                     labels, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("specd:request_queue_depth",
                                 "Requests in the request stream (XLEN: accepted, not yet answered).",
                                 labels, registry=r)
        self.queue_pending = Gauge("specd:request_queue_pending",
                                   "Requests a verifier has read and not yet acknowledged (XPENDING).",
                                   labels, registry=r)

    def observe_finished(self, *, finish_reason: str, spec_stats: SpecStats, num_prompt_tokens: int,
                         num_output_tokens: int, time_to_first_token: float, latency: float) -> None:
        m = self.model_name
        self.requests.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.generation_tokens.labels(m).inc(num_output_tokens)
        self.time_to_first_token.labels(m).observe(time_to_first_token)
        self.e2e_latency.labels(m).observe(latency)
        if num_output_tokens > 1:
            self.time_per_output_token.labels(m).observe((latency - time_to_first_token) / (num_output_tokens - 1))
        self.spec.observe(spec_stats)

    def observe_error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def set_queue(self, depth: int, pending: int) -> None:
        self.queue_depth.labels(self.model_name).set(depth)
        self.queue_pending.labels(self.model_name).set(pending)

    def render(self) -> bytes:
        return generate_latest(self.registry)
