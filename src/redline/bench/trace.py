"""Reading a profiled step out of torch.profiler's Chrome trace: host and device time per phase of the step.

The phases are the ``redline.PHASE`` spans the bench's runners mark (data, forward, backward, optimizer);
a GPU's kernels count for the phase whose span launched them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redline.bench.loops import PHASES
from redline.errors import TrainingError

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_EVENTS = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class Phase:
    """One phase of the step: host milliseconds per step and, on a GPU, its kernels' milliseconds per step."""

    name: str  # data, forward, backward, optimizer, or other (the step's time outside the four)
    host_ms: float
    share: float  # of the step's host time
    device_ms: float | None = None


@dataclass(frozen=True)
class Breakdown:
    """A profiled step, phase by phase, from the trace's events."""

    steps: int
    step_ms: float  # host wall time per step
    phases: tuple[Phase, ...]
    device_busy: float | None  # the share of the steps' wall time a GPU ran something (None on a CPU)


def read_breakdown(events: Sequence[dict[str, Any]]) -> Breakdown:
    """The per-step breakdown of a Chrome trace's events (times in microseconds, as torch.profiler writes them).

    Steps are the ``ProfilerStep#N`` spans; phases the ``redline.PHASE`` spans within them. A GPU's
    kernels, copies and memsets count for the phase whose span holds the call that launched them
    (matched by correlation id, from any host thread: backward launches from autograd's own).
    """
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    steps = [e for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        raise TrainingError(
            "the profiler recorded no step: its trace holds no ProfilerStep span\nhint: profile more --steps; "
            "if this persists, torch.profiler does not work in this environment (see `redline doctor`)"
        )
    n = len(steps)
    start = min(float(e["ts"]) for e in steps)
    end = max(float(e["ts"]) + float(e["dur"]) for e in steps)
    marked = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"].removeprefix("redline."))
        for e in spans
        if e.get("name", "").removeprefix("redline.") in PHASES and e["name"].startswith("redline.")
        and start <= float(e["ts"]) <= end
    )  # fmt: skip
    host = dict.fromkeys(PHASES, 0.0)
    for begin, finish, name in marked:
        host[name] += finish - begin
    step_us = sum(float(e["dur"]) for e in steps) / n
    per_step = {name: total / n for name, total in host.items()}
    per_step["other"] = max(0.0, step_us - sum(per_step.values()))
    device, busy = _device_time(events, marked, start, end)
    phases = tuple(
        Phase(
            name=name,
            host_ms=us / 1000,
            share=us / step_us if step_us else 0.0,
            device_ms=device[name] / n / 1000 if device is not None else None,
        )
        for name, us in per_step.items()
    )
    return Breakdown(steps=n, step_ms=step_us / 1000, phases=phases, device_busy=busy)


def _device_time(
    events: Sequence[dict[str, Any]], marked: list[tuple[float, float, str]], start: float, end: float
) -> tuple[dict[str, float] | None, float | None]:
    """Each phase's device microseconds (all steps) and the busy share of [start, end]; (None, None) without a GPU."""
    work = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_EVENTS]
    if not work:
        return None, None
    launched = {
        (e.get("args") or {}).get("correlation"): float(e["ts"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_EVENTS
    }
    begins = [begin for begin, _, _ in marked]
    device = {name: 0.0 for name in (*PHASES, "other")}
    intervals = []
    for event in work:
        ts, dur = float(event["ts"]), float(event["dur"])
        at = launched.get((event.get("args") or {}).get("correlation"))
        if at is not None and not start <= at <= end:
            continue  # launched outside the recorded steps (the warm-up's tail)
        name = "other"
        if at is not None:
            i = bisect.bisect_right(begins, at) - 1
            if i >= 0 and at <= marked[i][1]:
                name = marked[i][2]
        device[name] += dur
        intervals.append((max(ts, start), min(ts + dur, end)))
    return device, _covered(intervals) / (end - start) if end > start else None


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` (streams overlap: their kernels' sum would count twice)."""
    total, reach = 0.0, float("-inf")
    for begin, finish in sorted(intervals):
        if finish <= reach:
            continue
        total += finish - max(begin, reach)
        reach = finish
    return total
