"""From timed windows to a bench row's figures: rates, step-time percentiles, speed-ups, compile break-even.

Pure functions of the measured numbers, so a fake clock tests them. A window is ``window`` steps
timed between two device synchronisations; its steps queue on the device as in a real run, so
a window's time per step is the honest step time, where syncing every step would add the launch
latency the real run hides.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def rate(windows: Sequence[float], per_window: float) -> float | None:
    """``per_window`` units (samples, tokens) over the median window's seconds; None without windows.

    The median of the times, not of the rates: with an even count the two differ (the mean of the
    middle two rates is not the rate of their mean time), and a row's samples/s must agree with its
    p50 step time (``percentile(step_times(...), 50)``).
    """
    times = [t for t in windows if t > 0]
    return per_window / statistics.median(times) if times else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between the closest ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def step_times(windows: Sequence[float], window: int) -> list[float]:
    """Each window's time per step."""
    return [t / window for t in windows]


def break_even(compile_s: float | None, eager_step_s: float | None, compiled_step_s: float | None) -> float | None:
    """Steps after which a compile has paid for itself against the eager step; None if it never does."""
    if compile_s is None or eager_step_s is None or compiled_step_s is None:
        return None
    saved = eager_step_s - compiled_step_s
    return compile_s / saved if saved > 0 else None


def speedup(rate_: float | None, baseline: float | None) -> float | None:
    """``rate_`` over ``baseline``; None when either is missing."""
    if rate_ is None or baseline is None or baseline <= 0:
        return None
    return rate_ / baseline


def paired_interval(
    baseline: Sequence[float], windows: Sequence[float], confidence: float = 0.95
) -> tuple[float, float] | None:
    """Where the median speed-up over ``baseline`` lies, with ``confidence``: from each round's own ratio (the
    baseline's window time over this row's, timed in the same round, so a drift of the machine's speed weighs on
    both), by the order statistics a binomial gives the median of any distribution. None with too few rounds
    (six at 95%)."""
    ratios = sorted(b / w for b, w in zip(baseline, windows, strict=False) if b > 0 and w > 0)
    rank = _order_rank(len(ratios), (1 - confidence) / 2)
    return (ratios[rank - 1], ratios[len(ratios) - rank]) if rank else None


def _order_rank(n: int, tail: float) -> int:
    """The largest rank k (1-based; 0 if none) with P(Binomial(n, 1/2) < k) <= ``tail``: the median lies between
    the k-th smallest and the k-th largest of n values with confidence 1 - 2 x that probability."""
    below, rank, half = 0.0, 0, n * math.log(2)
    for i in range(n + 1):  # each term in logs: 2**n and the binomial coefficients of thousands of rounds overflow
        below += math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - half)
        if below > tail:
            break
        rank = i + 1
    return min(rank, (n + 1) // 2)
