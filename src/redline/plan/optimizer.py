"""Optimizer axis: whether redline rebuilds the optimizer with a fused implementation.

On CUDA a fused kernel is taken wherever the optimizer has one. On a CPU it is taken where its step, timed on a
copy of the parameters (runtime/fused.py), ran ``FUSED_MARGIN`` faster than the implementation given: on a Xeon with
AVX-512 fused AdamW stepped about 3x the default for-loop, and an earlier measurement on an AMD EPYC found it slower.
"""

from __future__ import annotations

import gc
import inspect
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from redline.hardware.device import DeviceFacts
from redline.plan import Choice

OptimizerImpl = Literal["fused", "as given"]
FUSED_MARGIN = 1.05  # on a CPU, fused is taken where its timed step is this much faster than the given one's
TIMED_DEVICES = ("cpu",)  # where the choice is timed: CUDA takes fused by rule, the others keep the given one
FUSABLE = ("cuda", *TIMED_DEVICES)


@dataclass(frozen=True)
class StepTiming:
    """An optimizer step's seconds as given and fused, timed side by side on a copy of (some of) its parameters."""

    given_s: float
    fused_s: float
    timed: int  # the parameter elements copied and timed
    of: int  # the optimizer's parameter elements
    cached_from: str = ""  # when the timing read from the cache was measured ("" where it was timed now)
    busy: float | None = None  # the share of the timing in which tasks waited for a CPU, where that made it uncached

    def told(self) -> str:
        """The timing in words: "0.36 ms against 1.13 ms a step, timed on a copy of its 417,536 parameters", and
        "; cached from 2026-12-07 10:52 UTC" where it was read from the cache, or why it was not cached."""
        copied = f"{self.of:,}" if self.timed >= self.of else f"{self.timed:,} of {self.of:,}"
        fused, given = _duration(self.fused_s), _duration(self.given_s)
        cached = f"; cached from {self.cached_from}" if self.cached_from else ""
        if self.busy is not None:
            cached = (
                f"; timed while the CPUs were busy (tasks waited for one {self.busy:.0%} of the time), so not cached: "
                "the next run times it again"
            )
        return f"{fused} against {given} a step, timed on a copy of its {copied} parameters{cached}"


def _duration(seconds: float) -> str:
    """A step's time, in ms, or in us where a hundredth of a ms would round it away."""
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.1f} us"


@dataclass(frozen=True, kw_only=True)
class OptimizerFacts:
    """What the resolver needs to know about the user's optimizer."""

    name: str
    has_fused: bool  # a torch.optim class whose constructor takes fused=
    has_state: bool  # it has stepped already; rebuilding would lose its moments
    impl_set_by_user: bool  # fused= or foreach= passed explicitly
    unfusable: str = ""  # why torch's fused kernels cannot take these parameters ("" where they can)
    has_scheduler: bool = False  # an LR scheduler was built on it: a rebuilt optimizer would leave it stepping this one


def optimizer_facts(
    optimizer: torch.optim.Optimizer,
    model: nn.Module | None = None,
    *,
    device: DeviceFacts | None = None,
    scan: bool = True,
) -> OptimizerFacts:
    """Read the facts of a built optimizer (and of the ``model`` it updates, whose layers may give sparse gradients).

    ``device``: where it will train. Given, the heap is scanned for a ReduceLROnPlateau (see ``scheduled``) only
    where resolve_optimizer's answer depends on it: not off CUDA, nor for an optimizer it keeps as given anyway.
    ``scan=False`` never scans: for an optimizer a factory has just built, on which no scheduler can be yet.
    """
    cls = type(optimizer)
    from_torch = cls.__module__.startswith("torch.optim")
    has_fused = from_torch and "fused" in inspect.signature(cls.__init__).parameters
    defaults = optimizer.defaults
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unfusable = ""
    if any(not p.is_floating_point() for p in params):  # complex parameters, say
        unfusable = "the model has parameters that are not real floating point"
    elif model is not None and any(getattr(m, "sparse", False) is True for m in model.modules()):
        unfusable = "the model has layers with sparse gradients (sparse=True)"
    has_state = any(bool(s) for s in optimizer.state.values())
    # None is torch's "not given"; fused=False turns fused off on purpose, like foreach=False.
    impl_set_by_user = defaults.get("fused") is not None or defaults.get("foreach") is not None
    decides = scan and has_fused and not has_state and not impl_set_by_user
    decides = decides and (device is None or device.type in FUSABLE)
    return OptimizerFacts(
        name=cls.__name__,
        has_fused=has_fused,
        has_state=has_state,
        impl_set_by_user=impl_set_by_user,
        unfusable=unfusable,
        has_scheduler=scheduled(optimizer, scan=decides),
    )


def scheduled(optimizer: torch.optim.Optimizer, *, scan: bool = True) -> bool:
    """Whether an LR scheduler was built on ``optimizer``.

    torch's schedulers record each group's ``initial_lr``, but for ReduceLROnPlateau, which sets the
    learning rate from a metric and records nothing on the optimizer: that one is found among the
    objects holding the optimizer, a scan of the heap (``scan``; about 80 ms for 5 million live containers).
    """
    return any("initial_lr" in group for group in optimizer.param_groups) or (scan and bool(schedulers_of(optimizer)))


def schedulers_of(optimizer: torch.optim.Optimizer) -> list[LRScheduler]:
    """The LR schedulers built on ``optimizer`` (ReduceLROnPlateau is one since torch 2.2), among the objects
    that hold it: a scan of the heap, for a one-off question, not for each step."""
    found = []
    for holder in gc.get_referrers(optimizer):
        if _scheduler_dict(holder, optimizer):  # a scheduler's __dict__, once asked for: found by a second scan
            holder = next((o for o in gc.get_referrers(holder) if isinstance(o, LRScheduler)), None)
        if isinstance(holder, LRScheduler) and getattr(holder, "optimizer", None) is optimizer:
            found.append(holder)
    return found


def _scheduler_dict(holder: object, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``holder`` may be an LR scheduler's ``__dict__``: every one sets ``last_epoch``, which a script's
    globals holding a variable named ``optimizer`` lack (they would cost a second scan of the heap)."""
    return isinstance(holder, dict) and holder.get("optimizer") is optimizer and "last_epoch" in holder


def resolve_optimizer(
    optimizer: OptimizerFacts,
    facts: DeviceFacts,
    *,
    sharded: bool = False,
    timed: StepTiming | str | None = None,
    deterministic: bool = False,
    stored: OptimizerImpl | None = None,
) -> Choice[OptimizerImpl]:
    """Use a fused kernel on CUDA where the optimizer has one, and on a CPU where ``timed`` found it faster; keep it
    as given everywhere else.

    ``sharded``: the parameters are FSDP2's DTensors, for which torch's default implementation is kept. ``timed``:
    on a CPU, the two implementations' step timed (``wants_timing``), or why they could not be (a clause).
    ``deterministic``: a CPU run that must repeat itself keeps the optimizer as given, untimed. ``stored``: the
    implementation a resumed run's checkpoint stepped with, taken untimed where a timing would decide.
    """
    if optimizer.impl_set_by_user:
        return Choice("as given", f"{optimizer.name}: implementation set by the user")
    if facts.type not in FUSABLE:
        return Choice("as given", f"{optimizer.name}: kept as given on {facts.type}, where fused is not tried")
    kept = _kept(optimizer, sharded=sharded)
    if kept is not None:
        return Choice("as given", kept)
    if facts.type == "cuda":
        return Choice("fused", f"{optimizer.name} rebuilt fused: one kernel updates every parameter")
    if deterministic:  # the two round differently, and a timing may choose otherwise on the next run
        return Choice("as given", f"{optimizer.name}: kept as given, as a deterministic run takes no timed choice")
    if stored is not None:  # a timing now could choose otherwise (a busy machine's), and the two round differently
        done = "rebuilt fused" if stored == "fused" else "kept as given"
        return Choice(stored, f"{optimizer.name} {done}, as the run it resumes stepped it")
    if timed is None:
        return Choice("as given", f"{optimizer.name}: kept as given, its fused kernel not timed on this {facts.type}")
    if isinstance(timed, str):
        return Choice("as given", f"{optimizer.name}: kept as given, as {timed}")
    speedup = timed.given_s / timed.fused_s if timed.fused_s > 0 else 0.0
    if speedup >= FUSED_MARGIN:
        return Choice("fused", f"{optimizer.name} rebuilt fused: it stepped {speedup:.2f}x as fast ({timed.told()})")
    return Choice(
        "as given",
        f"{optimizer.name}: kept as given, as fused stepped {speedup:.2f}x as fast, not {FUSED_MARGIN}x "
        f"({timed.told()})",
    )


def wants_timing(optimizer: OptimizerFacts, facts: DeviceFacts, *, sharded: bool = False) -> bool:
    """Whether ``resolve_optimizer`` decides by a timing of the two implementations (on a CPU, where nothing else
    keeps the optimizer as given)."""
    return facts.type in TIMED_DEVICES and not optimizer.impl_set_by_user and _kept(optimizer, sharded=sharded) is None


def _kept(optimizer: OptimizerFacts, *, sharded: bool) -> str | None:
    """Why ``optimizer`` is kept as given wherever it trains (None where a fused kernel may replace it)."""
    if not optimizer.has_fused:
        return f"{optimizer.name} has no fused implementation"
    if optimizer.has_state:
        return f"{optimizer.name} already holds state; rebuilding it would lose it"
    if optimizer.has_scheduler:  # the scheduler holds this optimizer: it would set the learning rate of one unused
        return (
            f"{optimizer.name}: an LR scheduler was built on it, which would go on stepping it and not a rebuilt one; "
            "build the scheduler on the optimizer setup returns for the fused kernel"
        )
    if optimizer.unfusable:  # torch's fused kernels refuse them at the first step
        return f"{optimizer.name}: {optimizer.unfusable}, which a fused kernel does not take"
    if sharded:
        return f"{optimizer.name} on FSDP2's sharded (DTensor) parameters: torch's default"
    return None


ZeroGrad = Literal["after step", "before backward"]


def resolve_zero_grad(facts: DeviceFacts) -> Choice[ZeroGrad]:
    """Decide when gradients are freed: right after the step, or just before the next backward.

    Both free them (set_to_none) and give the same numbers; they differ in memory traffic.
    """
    if facts.type == "cuda":
        return Choice("after step", "frees gradient memory for the forward; CUDA's caching allocator reuses it")
    # Measured on a 2-core CPU, digits CNN: freeing right after the step made the loop 3% slower than
    # the tutorial order, since the forward then re-faults freshly unmapped pages.
    return Choice("before backward", f"on {facts.type}, the tutorial order avoids re-faulting freed memory")
