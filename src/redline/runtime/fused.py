"""Timing an optimizer's step as given against torch's fused kernel for it, on a copy of its parameters.

On CUDA the fused kernel is taken by rule. On a CPU it depends on the machine: on a Xeon with AVX-512 fused AdamW
stepped about 3x the default for-loop (chargpt's 417,536 parameters: 0.36 ms against 1.13 ms), which made whole
training steps 4-8% faster; an earlier measurement on an AMD EPYC found it slower. So the Runtime times both before
it rebuilds anything (plan/optimizer.py decides): each steps a copy of the same parameters, with the same random
gradients, in rounds whose order rotates, after a first step that builds its state. The user's parameters, state
and hooks are not touched. A large model is timed on a copy of its first ``TIMED_BYTES`` of parameters: the check
costs a tenth of a second or so, and its copies (two, each with gradients and state) about 80 MiB at most.
A timing is cached (runtime/cache.py), keyed by the optimizer's kind, its options (of its learning rates, whether
each is a tensor), the shapes and dtypes of its parameters, and the machine: a second run here pays nothing and
takes the same implementation, where a fresh timing of two implementations a few percent apart could go either way.
One taken while other work kept the CPUs busy (``STALLED``) decides its own run only. Under ``deterministic=True``
nothing is timed nor read (a run that must repeat itself anywhere cannot depend on a timing), and under several
processes rank 0 times and every rank takes its choice: the two implementations round differently, and replicas
must step alike.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from redline.hardware.contention import Stalls, stalled
from redline.hardware.device import DeviceFacts
from redline.parallel.collectives import run_on_rank0
from redline.plan import Choice
from redline.plan.optimizer import (
    TIMED_DEVICES,
    OptimizerFacts,
    OptimizerImpl,
    StepTiming,
    optimizer_facts,
    resolve_optimizer,
    wants_timing,
)
from redline.runtime.cache import cache_key, read_cache, write_cache
from redline.runtime.optimizer import rebuild_optimizer, same_kind

TIMED_BYTES = 8 << 20  # of parameters copied at most: 2M fp32 elements; with gradients and Adam's state, 64 MiB
ROUNDS = 5
LEAST_ROUND_S = 0.002  # each round steps each implementation for at least this long (a step may take microseconds)
MOST_STEPS = 100  # steps per round at most
log = logging.getLogger("redline")
CACHED = "optimizer-steps"  # the cache's kind that keeps the timings
METHOD = 1  # how the timing measures, in its cache key: a change to it leaves what the old way measured unread


def pick_implementation(
    optimizer: torch.optim.Optimizer,
    facts: OptimizerFacts,
    device: DeviceFacts,
    *,
    sharded: bool,
    deterministic: bool,
    stored: OptimizerImpl | None = None,
) -> tuple[Choice[OptimizerImpl], torch.optim.Optimizer]:
    """The implementation ``optimizer`` steps with, and the optimizer rebuilt so where that is fused. On a CPU the
    two are timed first, unless the run is ``deterministic``, or resumes a checkpoint that ``stored`` its own. Under
    several processes rank 0 decides, by its own optimizer, and every rank takes its choice: a rank whose optimizer
    cannot be rebuilt (it has stepped) is refused at once, where a rank deciding alone would step otherwise, or wait
    in a collective the others never enter."""

    def decided() -> Choice[OptimizerImpl]:
        return _decide(optimizer, facts, device, sharded=sharded, deterministic=deterministic, stored=stored)

    if device.type not in TIMED_DEVICES or deterministic:  # nothing timed: every rank decides alike, by rule
        impl = decided()
    else:
        impl = run_on_rank0(decided, "timing the optimizer's fused kernel")
    return impl, rebuild_optimizer(optimizer, fused=True) if impl.value == "fused" else optimizer


def _decide(
    optimizer: torch.optim.Optimizer,
    facts: OptimizerFacts,
    device: DeviceFacts,
    *,
    sharded: bool,
    deterministic: bool,
    stored: OptimizerImpl | None = None,
) -> Choice[OptimizerImpl]:
    """resolve_optimizer's answer for ``optimizer``, with its step timed (or the timing read from the cache) where
    the answer depends on a timing (and no checkpoint ``stored`` it): a run's setup and a trial's copies decide so
    alike."""
    timing = stored is None and not deterministic and wants_timing(facts, device, sharded=sharded)
    timed = timed_or_cached(optimizer, device) if timing else None
    return resolve_optimizer(facts, device, sharded=sharded, timed=timed, deterministic=deterministic, stored=stored)


def as_the_run_steps(
    factory: Callable[[Any], torch.optim.Optimizer],
    model: nn.Module,
    device: DeviceFacts,
    *,
    sharded: bool,
    deterministic: bool,
) -> Callable[[Any], torch.optim.Optimizer]:
    """``factory``, its optimizers rebuilt fused where a Runtime's setup would rebuild the run's: for a trial's copies
    of ``model`` (whose layers tell sparse gradients), so that each form is timed stepping as the run will (on a CPU
    by the cached timing, taken here where none is, and read again by the run's setup). The first optimizer built
    decides for every later one (the copies' parameters are alike). A fresh optimizer is taken to have no LR
    scheduler yet (the heap is not scanned for one: tens of milliseconds a build); a factory that keeps a
    ReduceLROnPlateau of its own gets copies stepping fused where the run's setup would keep the optimizer."""
    decided: list[bool] = []  # whether fused, once the first optimizer is built

    def build(params: Any) -> torch.optim.Optimizer:
        optimizer = factory(params)
        if not isinstance(optimizer, torch.optim.Optimizer):  # refused where it is built (build_optimizer), named
            return optimizer
        if not decided:
            facts = optimizer_facts(optimizer, model, device=device, scan=False)
            impl = _decide(optimizer, facts, device, sharded=sharded, deterministic=deterministic)
            decided.append(impl.value == "fused")
        return rebuild_optimizer(optimizer, scan=False, fused=True) if decided[0] else optimizer

    return build


def timed_or_cached(optimizer: torch.optim.Optimizer, device: DeviceFacts) -> StepTiming | str:
    """``time_fused``'s answer for ``optimizer`` on this machine: cached, or timed now and cached (a timing that could
    not be made is not: the next run tries again; nor one taken while the CPUs were busy, ``STALLED``: the fused
    kernel's threads wait for each other, so another process's load slows it most, to 0.01x the for-loop beside a
    busy loop on a 2-core Xeon where it ran 3.0-3.4x quiet)."""
    key = cache_key(_fingerprint(optimizer), device, f"{TIMED_BYTES} bytes", f"method {METHOD}")
    cached = _read(key, of=_trained(optimizer))
    if cached is not None:
        return cached
    stalls = Stalls().start()
    timed = time_fused(optimizer)
    waited = stalls.stop()
    if isinstance(timed, StepTiming) and stalled(waited):
        return dataclasses.replace(timed, busy=waited)
    if isinstance(timed, StepTiming):
        write_cache(CACHED, key, [timed.given_s, timed.fused_s, timed.timed, timed.of])
    return timed


# torch's fused SGD with momentum refuses a group where some parameters with a gradient have a momentum buffer and some
# not (one's first gradient came after the optimizer's first step: a layer unfrozen later, a branch a step used
# first): TypeError "expected Tensor as element 0 in argument 2". The for-loop and foreach steps take it, as they build
# each buffer at the parameter's first gradient.
_UNFUSED: weakref.WeakKeyDictionary[torch.optim.Optimizer, str] = weakref.WeakKeyDictionary()


def step_unfusing(optimizer: torch.optim.Optimizer, step: Callable[[], object]) -> None:
    """Run ``step`` (``optimizer``'s, or the grad scaler's of it). Before it, where a fused SGD with momentum would
    refuse a parameter that got its first gradient after the optimizer's first step, the optimizer is set to step as
    given from here on (its momentum buffers serve both), said once and kept for the Plan (``unfused``). The check
    costs nothing once every parameter has a buffer, and a pass over the parameters while some have none."""
    if _late_buffer(optimizer):
        for group in optimizer.param_groups:
            group["fused"] = False
        optimizer.defaults["fused"] = False
        optimizer._step_supports_amp_scaling = False  # type: ignore[attr-defined]  # the scaler unscales, as for SGD
        _UNFUSED[optimizer] = (
            f"{type(optimizer).__name__}: stepped as given from a step where a parameter got its first gradient after "
            "the optimizer's first step (a layer unfrozen, a branch used late), which torch's fused SGD with momentum "
            "cannot take"
        )
        log.warning("%s; pass fused=False to step it so from the start", _UNFUSED[optimizer])
    step()


def _late_buffer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a fused SGD group with momentum holds parameters with a gradient both with and without a buffer."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    groups = [group for group in optimizer.param_groups if group.get("fused") and group.get("momentum")]
    state = optimizer.state
    if not groups or len(state) >= sum(len(group["params"]) for group in optimizer.param_groups):
        return False  # every parameter has had its first step: each has its buffer
    for group in groups:
        held = {
            p in state and state[p].get("momentum_buffer") is not None for p in group["params"] if p.grad is not None
        }
        if held == {True, False}:
            return True
    return False


def unfused(optimizer: torch.optim.Optimizer | None) -> str | None:
    """Why ``optimizer``, fused at setup, steps as given since (``step_unfusing``); None where it does not."""
    return _UNFUSED.get(optimizer) if optimizer is not None else None


def _fingerprint(optimizer: torch.optim.Optimizer) -> str:
    """What a step's time depends on: the optimizer's kind, each group's options (of its learning rates only whether
    each is a tensor, whose step takes other kernels: a schedule moves their values) and the shapes and dtypes of
    the parameters that train."""
    groups = [
        (
            sorted(
                (name, _lr_kind(value) if name.endswith("lr") else repr(value))
                for name, value in group.items()
                if name != "params"
            ),
            [(tuple(p.shape), str(p.dtype)) for p in group["params"] if p.requires_grad],
        )
        for group in optimizer.param_groups
    ]
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__} {groups!r}"


def _lr_kind(value: object) -> str:
    return f"tensor {value.dtype}" if isinstance(value, torch.Tensor) else "number"


def _read(key: str, *, of: int) -> StepTiming | None:
    """The timing cached under ``key``, or None where none is, or where the entry holds what no timing of an optimizer
    of ``of`` parameter elements writes (an edit, a damaged file): it is timed again."""
    found = read_cache(CACHED, key)
    if found is None or len(found[0]) != 4:
        return None
    (given_s, fused_s, timed, total), when = found
    seconds_ok = all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in (given_s, fused_s))
    counts_ok = all(isinstance(n, int) and not isinstance(n, bool) for n in (timed, total))
    if not seconds_ok or not counts_ok or total != of or not 0 < timed <= total:
        return None
    return StepTiming(given_s=given_s, fused_s=fused_s, timed=timed, of=total, cached_from=when)


def _trained(optimizer: torch.optim.Optimizer) -> int:
    """The parameter elements ``optimizer`` steps (those that train)."""
    return sum(p.numel() for group in optimizer.param_groups for p in group["params"] if p.requires_grad)


def time_fused(optimizer: torch.optim.Optimizer) -> StepTiming | str:
    """Time ``optimizer``'s step as given and fused on a copy of its parameters; return the seconds a step, or why
    they could not be timed (as a clause: "its fused kernel failed on a copy (...)")."""
    params = [list(group["params"]) for group in optimizer.param_groups]
    total = _trained(optimizer)
    copies = [_copies(params), _copies(params)]
    timed = sum(p.numel() for group in copies[0] for p in group)
    if not timed:
        return "none of its parameters trains, so there is no step to time"
    optimizers = []
    for impl, copied in zip(({}, {"fused": True}), copies, strict=True):
        try:  # torch refuses a dtype, device or option for its fused kernel at build or at the first step
            optimizers.append(same_kind(optimizer, copied, **impl))
            optimizers[-1].step()  # its state is built here: not timed
        except Exception as exc:
            error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            which = "its fused kernel" if impl else "its step as given"
            return f"{which} failed on a copy ({error})"
    given_s, fused_s = _timed(optimizers)
    return StepTiming(given_s=given_s, fused_s=fused_s, timed=timed, of=total)


def _copies(params: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Leaf copies of the parameters that train (a frozen one gets no gradient, and no step), a list per group, up to
    ``TIMED_BYTES`` of them (the last one cut short, flat), each with a seeded random gradient laid out as it is."""
    left, drawn = TIMED_BYTES, torch.Generator().manual_seed(0)
    copies: list[list[torch.Tensor]] = []
    for group in params:
        kept = []
        for param in (p for p in group if p.requires_grad):
            if left <= 0:
                break
            data, size = param.detach(), param.element_size()
            copy = (data if data.numel() * size <= left else data.reshape(-1)[: max(1, left // size)]).clone()
            left -= copy.numel() * size
            copy.grad = torch.empty_like(copy).copy_(torch.randn(copy.shape, generator=drawn)).mul_(1e-2)
            kept.append(copy)
        copies.append(kept)
    return copies


def _timed(optimizers: list[torch.optim.Optimizer]) -> list[float]:
    """Each optimizer's seconds a step (each has stepped once, building its state): the median over ``ROUNDS``
    rounds."""
    first = []
    for optimizer in optimizers:
        started = time.perf_counter()
        optimizer.step()
        first.append(time.perf_counter() - started)
    steps = max(1, min(MOST_STEPS, math.ceil(LEAST_ROUND_S / max(max(first), 1e-9))))
    rounds: list[list[float]] = [[] for _ in optimizers]
    for round_ in range(ROUNDS):
        for i in [(round_ + k) % len(optimizers) for k in range(len(optimizers))]:
            started = time.perf_counter()
            for _ in range(steps):
                optimizers[i].step()
            rounds[i].append((time.perf_counter() - started) / steps)
    return [statistics.median(times) for times in rounds]
