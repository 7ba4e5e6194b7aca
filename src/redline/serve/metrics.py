"""The server's Prometheus metrics, kept in a registry of the app's own (two apps in one process never mix)."""

from __future__ import annotations

import math

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds, from 0.5 ms (a tiny model's batch on a GPU) to 30 s (past the default deadline of 10 s).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Beyond 30 s, for a deadline (--timeout-ms) that long: a latency past the last bucket is counted in +Inf alone,
# and histogram_quantile then gives that last bucket's bound, 30 s, as the p99 of requests that took minutes.
LONG_BUCKETS = (60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
DEADLINE_MARGIN = 1.1  # an answer at the deadline goes out a little after it


def latency_buckets(timeout_s: float) -> tuple[float, ...]:
    """The time buckets of a server whose requests are answered within ``timeout_s``: the last one holds it."""
    longest = timeout_s * DEADLINE_MARGIN
    extra = [b for b in LONG_BUCKETS if b < longest]
    if longest > LATENCY_BUCKETS[-1]:
        extra.append(next((b for b in LONG_BUCKETS if b >= longest), float(math.ceil(longest))))
    return LATENCY_BUCKETS + tuple(extra)


class ServeMetrics:
    """Queue, compute and end-to-end time histograms, batch sizes, answers by status, refusals by reason."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch_size: int, *, timeout_s: float = 10.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        times = latency_buckets(timeout_s)
        sizes = sorted({1 << k for k in range(max_batch_size.bit_length())} | {max_batch_size})
        self.queue_seconds = Histogram(
            "redline_serve_queue_seconds", "Time a request waited in the queue before its batch ran.",
            buckets=times, registry=self.registry,
        )  # fmt: skip
        self.compute_seconds = Histogram(
            "redline_serve_compute_seconds", "Time the model took for one batch, postprocessing included.",
            buckets=times, registry=self.registry,
        )  # fmt: skip
        self.latency_seconds = Histogram(
            "redline_serve_latency_seconds", "Time from a prediction request's arrival to its answer (queued ones).",
            buckets=times, registry=self.registry,
        )  # fmt: skip
        self.batch_samples = Histogram(
            "redline_serve_batch_samples", "Samples in each batch the model ran.", buckets=sizes, registry=self.registry
        )
        self.batch_requests = Histogram(
            "redline_serve_batch_requests", "Requests in each batch the model ran.", buckets=sizes,
            registry=self.registry,
        )  # fmt: skip
        self.requests = Counter(
            "redline_serve_requests", "Prediction requests answered, by HTTP status.", ["status"],
            registry=self.registry,
        )  # fmt: skip
        self.rejections = Counter(
            "redline_serve_rejections", "Requests refused, by reason: on every path, unknown ones included.",
            ["reason"], registry=self.registry,
        )  # fmt: skip
        self.queued = Gauge("redline_serve_queued_requests", "Requests waiting in the queue.", registry=self.registry)

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
