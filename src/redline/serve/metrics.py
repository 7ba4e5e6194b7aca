"""The server's Prometheus metrics, kept in a registry of the app's own (two apps in one process never mix)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds, from 0.5 ms (a tiny model's batch on a GPU) to 30 s (past any sensible deadline).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServeMetrics:
    """Queue, compute and end-to-end time histograms, batch sizes, answers by status, refusals by reason."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch_size: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        sizes = sorted({1 << k for k in range(max_batch_size.bit_length())} | {max_batch_size})
        self.queue_seconds = Histogram(
            "redline_serve_queue_seconds", "Time a request waited in the queue before its batch ran.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.compute_seconds = Histogram(
            "redline_serve_compute_seconds", "Time the model took for one batch, postprocessing included.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.latency_seconds = Histogram(
            "redline_serve_latency_seconds", "Time from a prediction request's arrival to its answer (queued ones).",
            buckets=LATENCY_BUCKETS, registry=self.registry,
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
