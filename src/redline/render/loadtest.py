"""`redline loadtest`'s result as rich tables: what was driven, latency percentiles, and counts by outcome."""

from __future__ import annotations

from rich.table import Table

from redline.render.console import key_value_table
from redline.serve.load_stats import LatencyStats, LoadResult


def loadtest_tables(result: LoadResult) -> list[Table]:
    """The run's load and throughput, its latency percentiles, and its counts by status and client error."""
    if result.mode == "open":
        load = f"open loop, {result.target_rate:g} requests/s ({result.arrivals} arrivals)"
    else:
        load = f"closed loop, {result.concurrency} workers"
    rows = [
        ("target", f"{result.method} {result.url}"),
        ("load", load),
        ("window", f"{result.duration_s:g} s after {result.warmup_s:g} s of warm-up ({result.elapsed_s:.1f} s in all)"),
        (
            "requests",
            f"{result.requests_sent} sent, {result.requests_completed} answered, {result.requests_failed} failed",
        ),
        ("achieved", f"{result.achieved_rps:.1f} requests/s ({result.success_rps:.1f} 2xx/s)"),
    ]
    if result.send_lag_ms is not None:
        kept = "yes" if result.client_kept_up else "NO: see the note"
        rows.append(("client kept up", f"{kept} (send lag p99 {result.send_lag_ms.p99_ms:.2f} ms)"))
    if result.waited_for_slot:
        rows.append(("queued in client", f"{result.waited_for_slot} (max {result.max_in_flight} in flight)"))
    tables = [key_value_table(rows, "load test")]
    origin = "each request's scheduled send time" if result.mode == "open" else "each request's actual send"
    latency = Table(title=f"latency in ms, from {origin}", title_justify="left", caption_justify="left",
                    caption=f"percentiles: {result.percentile_method}")  # fmt: skip
    latency.add_column("requests")
    for column in ("count", "mean", "p50", "p90", "p99", "p99.9", "max"):
        latency.add_column(column, justify="right")
    for label, stats in (("all answered", result.latency_ms), ("2xx only", result.latency_2xx_ms),
                         ("send lag (client)", result.send_lag_ms)):  # fmt: skip
        if stats is not None:
            latency.add_row(label, *_cells(stats))
    tables.append(latency)
    outcomes = Table(title="outcomes", title_justify="left")
    outcomes.add_column("status or error")
    outcomes.add_column("count", justify="right")
    for code, count in sorted(result.status_counts.items()):
        outcomes.add_row(str(code), str(count))
    for kind, count in sorted(result.error_counts.items()):
        outcomes.add_row(kind.replace("_", " "), str(count), style="red")
    tables.append(outcomes)
    return tables


def _cells(stats: LatencyStats) -> list[str]:
    figures = (stats.mean_ms, stats.p50_ms, stats.p90_ms, stats.p99_ms, stats.p999_ms, stats.max_ms)
    return [str(stats.count), *(f"{value:.2f}" for value in figures)]
