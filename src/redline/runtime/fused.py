"""Timing an optimizer's step as given against torch's fused kernel for it, on a copy of its parameters.

On CUDA the fused kernel is taken by rule. On a CPU it depends on the machine: on a Xeon with AVX-512 fused AdamW
stepped about 3x the default for-loop (chargpt's 417,536 parameters: 0.36 ms against 1.13 ms), which made whole
training steps 4-8% faster; an earlier measurement on an AMD EPYC found it slower. So the Runtime times both before
it rebuilds anything (plan/optimizer.py decides): each steps a copy of the same parameters, with the same random
gradients, in rounds whose order rotates, after a first step that builds its state. The user's parameters, state
and hooks are not touched. A large model is timed on a copy of its first ``TIMED_ELEMENTS`` elements, so the check
costs a fraction of a second and a few tens of MiB at most.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from redline.hardware.device import DeviceFacts
from redline.parallel.collectives import run_on_rank0
from redline.plan import Choice
from redline.plan.optimizer import OptimizerFacts, OptimizerImpl, StepTiming, resolve_optimizer, wants_timing
from redline.runtime.optimizer import rebuild_optimizer, same_kind

TIMED_ELEMENTS = 1 << 21  # elements copied at most (8 MiB in fp32; with gradients and Adam's state, 64 MiB in all)
ROUNDS = 5
LEAST_ROUND_S = 0.002  # each round steps each implementation for at least this long (a step may take microseconds)
MOST_STEPS = 100  # steps per round at most


def pick_implementation(
    optimizer: torch.optim.Optimizer, facts: OptimizerFacts, device: DeviceFacts, *, sharded: bool
) -> tuple[Choice[OptimizerImpl], torch.optim.Optimizer]:
    """The implementation ``optimizer`` steps with, and the optimizer rebuilt so where that is fused. On a CPU the
    two are timed first; under several processes rank 0 times them and every rank takes its choice, so the replicas
    step alike (the two round differently)."""
    timed = None
    if wants_timing(facts, device, sharded=sharded):
        timed = run_on_rank0(lambda: time_fused(optimizer), "timing the optimizer's fused kernel")
    impl = resolve_optimizer(facts, device, sharded=sharded, timed=timed)
    return impl, rebuild_optimizer(optimizer, fused=True) if impl.value == "fused" else optimizer


def time_fused(optimizer: torch.optim.Optimizer) -> StepTiming | str:
    """Time ``optimizer``'s step as given and fused on a copy of its parameters; return the seconds a step, or why
    the fused kernel could not step them (its error's first line)."""
    params = [list(group["params"]) for group in optimizer.param_groups]
    total = sum(p.numel() for group in params for p in group if p.requires_grad)
    try:
        given, fused = (same_kind(optimizer, _copies(params), **impl) for impl in ({}, {"fused": True}))
        seconds = _timed([given, fused])
    except Exception as exc:  # torch refuses a dtype or device for its fused kernel, at build or at the first step
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    timed = sum(p.numel() for group in given.param_groups for p in group["params"])
    return StepTiming(given_s=seconds[0], fused_s=seconds[1], timed=timed, of=total)


def _copies(params: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Leaf copies of the parameters that train (a frozen one gets no gradient, and no step), up to
    ``TIMED_ELEMENTS`` elements (the last one cut short, flat), each with a seeded random gradient laid out as it is."""
    left, drawn = TIMED_ELEMENTS, torch.Generator().manual_seed(0)
    copies: list[list[torch.Tensor]] = []
    for group in params:
        kept = []
        for param in (p for p in group if p.requires_grad):
            if left <= 0:
                break
            data = param.detach()
            copy = (data if data.numel() <= left else data.reshape(-1)[:left]).clone()
            left -= copy.numel()
            copy.grad = torch.empty_like(copy).copy_(torch.randn(copy.shape, generator=drawn)).mul_(1e-2)
            kept.append(copy)
        copies.append(kept)
    return copies


def _timed(optimizers: list[torch.optim.Optimizer]) -> list[float]:
    """Each optimizer's seconds a step: the median over ``ROUNDS`` rounds, after a first step that builds state."""
    first = []
    for optimizer in optimizers:
        optimizer.step()  # its state is built here: not timed
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
