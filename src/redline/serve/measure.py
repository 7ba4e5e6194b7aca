"""Timing the engine's candidate settings on its largest and smallest buckets, and caching what was measured.

Each setting (the reference first) runs through the runner the engine will use (eager, or a
captured CUDA graph), on a zero batch of the bucket: a few warm-up calls, then timed blocks
taking turns (``runtime.trial.time_steps``), each call including the copy of its outputs to the CPU
as ``predict`` does. A timed step is one call, or as many calls as last ``MIN_STEP_S`` where one
is shorter: the digits CNN's single-sample call takes 0.1 ms on a CPU, and a block of three such
calls was mostly the machine's jitter (it timed channels_last at 0.79x fp32 in one run, 1.11-1.18x
in others). Its outputs on a seeded random batch are compared with the reference's. The numbers
are cached under ``$REDLINE_CACHE_DIR/inference/``, keyed by the model's fingerprint and weights,
this machine, the buckets, the input and the settings, so a restarted server measures nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from redline.errors import describe_error
from redline.hardware.contention import Stalls, stalled
from redline.hardware.device import DeviceFacts
from redline.plan.inference import Setting, Timing
from redline.runtime.cache import cache_key, read_cache, write_cache
from redline.runtime.cuda_errors import is_sticky_cuda_error
from redline.runtime.trial import time_steps

WARMUP_CALLS = 3
ROUNDS, BLOCK = 5, 3  # timed blocks per setting, and calls per block
CACHE_KIND = "inference"  # the cache's folder for the engine's measurements
MAX_SECONDS = 20.0  # timing stops after two rounds once this much was spent
MIN_STEP_S = 0.002  # a timed step is as many calls as take this long (one call, where that takes longer)
MOST_CALLS = 64  # the most calls a timed step makes

log = logging.getLogger("redline")

Runner = Callable[[torch.Tensor], torch.Tensor]  # a batch of the largest bucket in, CPU outputs out


def time_settings(
    runners: Sequence[tuple[Setting, Callable[[], Runner]]],
    zeros: torch.Tensor,
    probe: torch.Tensor,
    *,
    sync: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
    stalls: Stalls | None = None,
) -> list[Timing]:
    """Time each setting's runner (built by its factory; the first is the reference) and judge its outputs.

    A candidate whose runner cannot be built or fails on the batch is recorded as failed with the
    error; the reference's failure, or a sticky CUDA error, is raised. ``stalls`` counts the CPU waits of the timed
    rounds alone (a build compiles, its workers our own tasks).
    """
    built: list[tuple[Setting, Runner]] = []
    failed: dict[Setting, str] = {}
    outputs: dict[Setting, torch.Tensor] = {}
    for setting, build in runners:
        try:
            runner = build()
            outputs[setting] = runner(probe).float()
        except Exception as exc:  # a candidate that cannot run is rejected, the engine goes on
            if is_sticky_cuda_error(exc) or setting == runners[0][0]:
                raise  # the device is lost, or the model itself fails: nothing to compare against
            failed[setting] = f"it failed: {describe_error(exc)}"
            continue
        built.append((setting, runner))
    for _ in range(WARMUP_CALLS):
        for _, runner in built:
            runner(zeros)
    calls = [calls_per_step(runner, zeros, sync=sync, clock=clock) for _, runner in built]
    steps = [_step(runner, zeros, n) for (_, runner), n in zip(built, calls, strict=True)]
    settle = [_step(runner, zeros, 1) for _, runner in built]
    with stalls.counting() if stalls is not None else contextlib.nullcontext():
        times, _ = time_steps(steps, warmup=0, rounds=ROUNDS, block=BLOCK, sync=sync, clock=clock,
                              budget_s=MAX_SECONDS, settle=settle)  # fmt: skip
    reference = outputs.get(runners[0][0])
    timed = {
        setting: Timing(setting, _blocks([t / n for t in step_times]), _error(outputs[setting], reference))
        for (setting, _), step_times, n in zip(built, times, calls, strict=True)
    }
    return [timed.get(setting) or Timing(setting, failed=failed[setting]) for setting, _ in runners]


def calls_per_step(runner: Runner, zeros: torch.Tensor, *, sync: Callable[[], None], clock: Callable[[], float]) -> int:
    """How many calls of ``runner`` a timed step makes: enough for ``MIN_STEP_S`` at the speed of one call (warmed
    up, timed now), ``MOST_CALLS`` at most. Each setting gets its own count: its time per call is what compares."""
    start = clock()
    runner(zeros)
    sync()
    took = clock() - start
    return 1 if took >= MIN_STEP_S else min(MOST_CALLS, math.ceil(MIN_STEP_S / max(took, 1e-9)))


def _step(runner: Runner, zeros: torch.Tensor, calls: int) -> Callable[[], float]:
    def step() -> float:
        for _ in range(calls):
            runner(zeros)
        return 0.0

    return step


def _blocks(calls: Sequence[float]) -> tuple[float, ...]:
    """Seconds per call of each block of BLOCK timed steps, from each step's seconds per call."""
    return tuple(sum(calls[i : i + BLOCK]) / BLOCK for i in range(0, len(calls) - BLOCK + 1, BLOCK))


def _error(outputs: torch.Tensor, reference: torch.Tensor | None) -> float:
    """max |outputs - reference| relative to the reference's largest magnitude (0.0 for the reference itself)."""
    if reference is None or outputs is reference:
        return 0.0
    if outputs.shape != reference.shape:
        return float("inf")
    scale = max(float(reference.abs().max()), 1e-6) if reference.numel() else 1.0
    return float((outputs - reference).abs().max()) / scale if outputs.numel() else 0.0


def measure_key(
    fingerprint: str,
    facts: DeviceFacts,
    *,
    buckets: Sequence[int],
    input_shape: tuple[int, ...],
    input_dtype: str,
    settings: Sequence[Setting],
    graphs: bool,
) -> str:
    """The cache key of a measurement: the model, everything about this machine that times it, and what was timed."""
    labels = ",".join(s.label for s in settings)
    what = (",".join(map(str, buckets)), str(input_shape), input_dtype, labels, str(graphs))
    return cache_key(fingerprint, facts, *what, f"{ROUNDS}x{BLOCK}, steps of {MIN_STEP_S:g} s")


def weights_digest(model: torch.nn.Module) -> str:
    """A short hash of the model's tensor values (each one's sum and sum of magnitudes, in float64).

    The measurement's accuracy verdict depends on the weights: new weights (a retrained model,
    ``--weights``) must be measured again, while the same weights on the next start find the cache.
    """
    tensors = [t.detach() for t in model.state_dict().values() if t.numel()]
    if not tensors:
        return "none"
    with torch.no_grad():
        sums = torch.stack([torch.stack([t.double().sum(), t.double().abs().sum()]) for t in tensors])
    return hashlib.sha256(sums.cpu().numpy().tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class Cached:
    """What the cache holds for a measurement's key: each bucket's timings, or why capturing CUDA graphs failed."""

    when: str
    timings: dict[int, list[Timing]] = field(default_factory=dict)
    capture_failed: str = ""


def load_measured(key: str) -> Cached | None:
    """The cached measurement of ``key`` and when it was made, or None (absent, or unreadable: measured again)."""
    found = read_cache(CACHE_KIND, key)
    if not found:
        return None
    entries, when = found
    if len(entries) == 1 and isinstance(entries[0], dict) and "capture_failed" in entries[0]:
        return Cached(when, capture_failed=str(entries[0]["capture_failed"]))
    timings: dict[int, list[Timing]] = {}
    try:
        for entry in entries:
            timings.setdefault(int(entry["bucket"]), []).append(Timing.from_dict(entry))
    except (ValueError, KeyError, TypeError):
        return None
    return Cached(when, timings) if timings else None


def store_capture_failure(key: str, reason: str) -> None:
    """Cache that capturing failed, under the measurement's key with graphs, so the next start skips the capture."""
    write_cache(CACHE_KIND, key, [{"capture_failed": reason}])


def store_unless_busy(key: str, timings: Mapping[int, Sequence[Timing]], waited: float | None) -> str:
    """Cache ``timings`` under ``key`` unless tasks waited for a CPU a ``STALLED`` share of their timing or more
    (``stalled``: another process's load, which slows a parallel kernel most, bf16 and compiled ones among them, so a
    busy verdict is this start's alone); say which, for the Plan."""
    if stalled(waited):
        return f"measured now, while the CPUs were busy (tasks waited for one {waited:.0%} of the time), so not cached"
    store_measured(key, timings)
    return "measured now"


def store_measured(key: str, timings: Mapping[int, Sequence[Timing]]) -> None:
    """Cache each bucket's timings, atomically; a cache that cannot be written is skipped with a warning."""
    write_cache(CACHE_KIND, key, [{"bucket": bucket, **t.to_dict()} for bucket, ts in timings.items() for t in ts])
