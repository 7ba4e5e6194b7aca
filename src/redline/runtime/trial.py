"""Trials: a few timed training steps of the user's own model per candidate, so "auto" is measured.

A rule of thumb proposes the candidates (bf16 only where the device has bf16 arithmetic, say);
the trial decides. Each candidate trains a copy of the model and a fresh optimizer on one real
batch, on the run's device, for a few warm-up steps and a few timed ones, each step synchronised.
The run itself is untouched: the RNG state is put back afterwards. A candidate whose loss departs
from the fp32 reference, or turns non-finite, is rejected; one must beat fp32 by a margin to be
chosen, so noise never makes auto slower than the plain fp32 loop.

The timing and the choice are pure functions of the measured numbers (a fake clock tests them).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from redline.errors import RedlineError, TaskError, describe_error, first_line
from redline.hardware.device import DeviceFacts
from redline.plan import Choice, times
from redline.plan.attention import KERNELS
from redline.runtime.cache import cache_key, read_cache, write_cache
from redline.runtime.contract import blames_user_code
from redline.runtime.oom import free_memory, is_oom
from redline.runtime.seed import capture_rng, restore_rng
from redline.runtime.transfer import device_sync, move_to
from redline.runtime.trial_copy import TrainingCopy, Turns

WARMUP_STEPS = 1  # the first step, whose loss is compared; each round's settling step warms up the rest
ROUNDS, BLOCK = 4, 3  # timed blocks per candidate, and timed steps per block (after one settling step)
TIMED_STEPS = ROUNDS * BLOCK
MARGIN = 1.10  # a candidate must run this much faster than fp32 to be chosen: the trial's error on whole runs
REACH = 1 + (MARGIN - 1) / 2  # after two rounds, a candidate not this much faster than fp32 is given up on
CLEAR = MARGIN * 1.1  # after two rounds, a candidate this much faster than fp32 has won: its lead dwarfs the noise
# After one round, a candidate this much faster than fp32 has won: the rounds after the first moved a lead by
# 0.80-1.33x over 60 whole trials (benchmarks/results/trial-rounds-cpu.md), and 1.5 x 0.80 still clears MARGIN.
DECISIVE = 1.5
TOLERANCE = 0.05  # relative departure of a candidate's first loss from fp32's that rejects it
MAX_SECONDS = 30.0  # the whole trial; a candidate that would exceed it is timed on fewer steps
# How a trial measures, in its cache key: a change to it leaves what the old way measured unread. 2: a candidate
# whose step fails laid out NHWC is timed in NCHW, where the run would go back to (it was rejected). 3: a run that
# does not repay whole steps on every attention kernel times each precision on the kernel its calls prefer. 4: each
# copy's optimizer steps as the run's will, fused where the Runtime's setup rebuilds it so (runtime/fused.py).
METHOD = 4

log = logging.getLogger("redline")


@dataclass(frozen=True)
class Measured:
    """One candidate's trial: its step times (seconds), its losses, and why it was rejected ("" if not)."""

    precision: str
    step_times: tuple[float, ...]
    losses: tuple[float, ...]
    rejected: str = ""
    out_of_memory: bool = False  # rejected for memory: a machine with more free would time it (never cached)

    @property
    def step_s(self) -> float:
        """The fastest step: what the choice compares. A shared machine's noise only adds time, so the
        fastest of a dozen steps is the steadiest figure (medians of the same trials spread 0.90-1.15x
        where the fastest steps gave 0.97-1.06x).
        """
        return min(self.step_times) if self.step_times else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "step_times": list(self.step_times),
            "losses": list(self.losses),
            "rejected": self.rejected,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measured:
        """A cached candidate; ValueError or TypeError where an entry edited or damaged on disk holds what no trial
        writes (a step that took no time, a loss that is not a number)."""
        precision, rejected = data["precision"], data.get("rejected", "")
        if not isinstance(precision, str) or not isinstance(rejected, str):
            raise TypeError(f"precision {precision!r} and rejected {rejected!r} are not texts")
        times, losses = _numbers(data["step_times"]), _numbers(data["losses"])
        if not all(math.isfinite(t) and t > 0 for t in times):
            raise ValueError(f"step_times {list(times)} are not all positive")
        return cls(precision, times, losses, rejected)


def _numbers(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list | tuple) or any(isinstance(v, bool) or not isinstance(v, int | float) for v in value):
        raise TypeError(f"{value!r} is not a list of numbers")
    return tuple(float(v) for v in value)


def time_steps(
    steps: Sequence[Callable[[], float]],
    *,
    warmup: int = WARMUP_STEPS,
    rounds: int = ROUNDS,
    block: int = BLOCK,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
    budget_s: float = math.inf,
    settle: Sequence[Callable[[], float]] | None = None,
    settled: Callable[[list[list[float]], int], bool] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Time several step functions (each returns its loss) side by side, in blocks that take turns.

    Each runs ``warmup`` untimed steps first. Then every round gives each a block: one untimed step
    that brings its memory back into the caches the others used (``settle[i]`` when given, else the
    step itself: a timed "step" may be a window of several), then ``block`` timed steps, each
    synchronised (``sync``). The order rotates from round to round, so a machine whose speed drifts
    (a clock ramping up, a neighbour's load) weighs on all alike. Timing stops once ``budget_s`` is
    spent (after two rounds at least), or once ``settled(times, rounds_done)`` says the rounds left
    would change nothing. Returns, per step function, the timed durations and every loss (untimed
    steps included).
    """
    losses: list[list[float]] = [[] for _ in steps]
    times: list[list[float]] = [[] for _ in steps]
    for index, step in enumerate(steps):
        losses[index] += [step() for _ in range(warmup)]
    spent = 0.0
    for round_ in range(rounds):
        for offset in range(len(steps)):
            index = (round_ + offset) % len(steps)
            start = clock()
            losses[index].append((settle or steps)[index]())  # the settling step
            sync()
            spent += clock() - start  # untimed, but the budget's: on a window of one it is half the time
            for _ in range(block):
                start = clock()
                losses[index].append(steps[index]())
                sync()
                times[index].append(clock() - start)
                spent += times[index][-1]
        if (round_ >= 1 and spent >= budget_s) or (settled is not None and settled(times, round_ + 1)):
            break
    return times, losses


def judge(reference: Measured, candidate: Measured, tolerance: float = TOLERANCE) -> str:
    """Return why ``candidate`` is rejected against the fp32 ``reference`` ("" when it is not)."""
    if not all(math.isfinite(loss) for loss in candidate.losses):
        return "a loss turned non-finite"
    if not candidate.losses or not reference.losses:
        return "no loss was measured"
    first, expected = candidate.losses[0], reference.losses[0]
    departure = abs(first - expected) / max(abs(expected), 1e-8)
    if departure > tolerance:
        return f"its first loss {first:.4g} is {departure:.1%} off fp32's {expected:.4g} (tolerance {tolerance:.0%})"
    return ""


def choose(measured: Sequence[Measured], where: str, margin: float = MARGIN) -> Choice[str]:
    """Return the precision to run and the Plan's reason, from measurements whose first is fp32's.

    The fastest accepted candidate wins if it beats fp32 by ``margin``; otherwise fp32 stays.
    """
    reference, *others = measured
    steps = len(reference.step_times)
    accepted = [m for m in others if not m.rejected]
    ratios = {m.precision: reference.step_s / m.step_s for m in others if m.step_times}
    told = ", ".join(
        f"{m.precision} rejected: {m.rejected}" if m.rejected else f"{m.precision} {times(ratios[m.precision])}"
        for m in others
    )
    timing = f"fastest of {steps} timed steps each on {where}; fp32 {reference.step_s * 1e3:.3g} ms"
    best = min(accepted, key=lambda m: m.step_s, default=None)
    if best is not None and reference.step_s / best.step_s >= margin:
        return Choice(best.precision, f"measured: {best.precision} ran {times(ratios[best.precision])} fp32 ({timing})")
    why = f"no candidate beat it by {margin - 1:.0%}" if not any(m.rejected for m in others) else "none qualified"
    return Choice("fp32", f"measured: fp32 kept, {why}: {told} ({timing})")


def run_trial(
    model: nn.Module,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batch: tuple[Any, Any],
    device: torch.device,
    candidates: Sequence[str],
    *,
    clock: Callable[[], float] = time.perf_counter,
    max_seconds: float = MAX_SECONDS,
    zero_after_step: bool = False,
    stop_early: bool = True,
    rounds: int = ROUNDS,
    layout: Callable[[str], bool] = lambda precision: False,
    nchw_fallback: bool = False,
) -> list[Measured]:
    """Measure fp32 and each candidate side by side on copies of ``model``; the RNG is left as it was.

    A candidate is a precision, or a precision with the attention kernel its steps prefer (``form``).

    ``model`` is not changed: each candidate trains its own deep copy, built on ``device``, with a
    fresh optimizer from the factory, on the one ``batch``, freeing its gradients where the Runtime
    does (``zero_after_step``: after the step, as on a GPU; else before backward, as on a CPU); one copy
    at a time holds gradients and optimizer state (runtime/trial_copy.py), so the trial needs the memory of
    one run. A candidate that cannot run at all (a kernel missing in its precision) is rejected with the
    error, and one that ran out of memory is marked ``out_of_memory``.
    The timing runs ``rounds`` rounds at most (a short run's trial has fewer). ``layout(precision)`` says whether
    the run would lay the model and its images out channels_last under that precision: each is timed so, and with
    ``nchw_fallback`` (the run goes back to NCHW where the model fails in NHWC: runtime/layout.py) a precision whose
    first step fails so is timed in NCHW.
    With ``stop_early``, the timing ends once the rounds left could hardly change the choice
    (``decided``): a trial that finds nothing is the run's loss, and one that finds a clear winner
    need not confirm it twice.
    """
    inputs, targets = move_to(batch, device)
    sync = device_sync(device)
    names: list[str] = ["fp32", *candidates]
    saved, turns = capture_rng(), Turns()
    try:
        steps, failed, short_of_memory = {}, {}, set()
        for name in names:
            nhwc_first = layout(form_parts(name)[0])
            for nhwc in [True, False] if nhwc_first and nchw_fallback else [nhwc_first]:
                try:
                    copied = copy_model(model)
                except (RuntimeError, TypeError, copy.Error) as exc:  # a lock, a generator: what deepcopy refuses
                    failed[name] = f"the model cannot be copied for a trial: {describe_error(exc)}"
                    break
                trainer = None
                try:
                    trainer = TrainingCopy(
                        copied, optimizer, loss_fn, (inputs, targets), device, form_parts(name), turns,
                        zero_after_step=zero_after_step, channels_last=nhwc, inside=nchw_fallback,
                    )  # fmt: skip
                    torch.manual_seed(0)  # the first step of each draws the same dropout masks: its loss compares
                    steps[name] = (trainer, trainer.step())
                    failed.pop(name, None)
                    break
                except Exception as exc:
                    if not _fails_the_candidate(exc):
                        raise
                    failed[name] = f"it failed: {_first_line(exc)}"
                    if is_oom(exc):  # memory, not the layout: the run would stay in it
                        short_of_memory.add(name)
                        break
                finally:
                    turns.end()  # the next copy is made with none of this one's training state held
                    del copied, trainer  # nor, where it failed, its weights
            if name in short_of_memory:
                free_memory(device)  # what the failed step held, in a traceback's cycles
        timed = [name for name in names if name in steps]
        while True:  # a step out of memory takes its candidate out (rejected so), and the others are timed anew
            settled = _settled_by_the_accepted(timed, steps) if stop_early and timed[:1] == ["fp32"] else None
            try:
                times, losses = time_steps(
                    [_guarded(name, steps[name][0]) for name in timed], warmup=WARMUP_STEPS - 1, rounds=rounds,
                    sync=sync, clock=clock, budget_s=max_seconds, settled=settled,
                )  # fmt: skip
                break
            except _OutOfMemory as exc:
                turns.end()
                timed.remove(exc.name)
                failed[exc.name] = f"it failed: {_first_line(exc.cause)}"
                short_of_memory.add(exc.name)
            free_memory(device)
    finally:
        turns.end(offload=False)  # nothing of the trial's training state outlives it, for the run to pay
        restore_rng(saved)
    results = {
        name: Measured(name, tuple(timing), (steps[name][1], *rest))
        for name, timing, rest in zip(timed, times, losses, strict=True)
    }
    results.update({name: Measured(name, (), (), why, name in short_of_memory) for name, why in failed.items()})
    reference = results["fp32"]
    return [reference, *(_with_verdict(reference, results[name]) for name in candidates)]


def _settled_by_the_accepted(timed: list[str], steps: dict[str, tuple[Any, float]]) -> Callable[..., bool]:
    """``decided`` over fp32 and the candidates whose first loss passes ``judge``: a lead of one rejected after
    the timing (its first loss 20% off fp32's) must not end the trial for another candidate's three steps."""
    first = {name: Measured(name, (), (steps[name][1],)) for name in timed}
    kept = [i for i, name in enumerate(timed) if i == 0 or not judge(first["fp32"], first[name])]
    return lambda times, rounds: decided([times[i] for i in kept], rounds)


class _OutOfMemory(Exception):
    """A timed step of the candidate ``name`` ran out of memory (``cause``)."""

    def __init__(self, name: str, cause: Exception) -> None:
        super().__init__(name)
        self.name, self.cause = name, cause


def _guarded(name: str, trainer: TrainingCopy) -> Callable[[], float]:
    """``trainer``'s step, raising ``_OutOfMemory`` where it runs out of memory: the trial goes on without it."""

    def step() -> float:
        try:
            return trainer.step()
        except Exception as exc:
            if is_oom(exc):
                raise _OutOfMemory(name, exc) from exc
            raise

    return step


def decided(times: list[list[float]], rounds: int, *, decisive: float = DECISIVE) -> bool:
    """Whether the rounds left could hardly change the choice, from the fastest steps so far: fp32's in
    ``times[0]``, the candidates' after it, ``rounds`` rounds in.

    Chosen, a candidate must run ``MARGIN`` (10%) faster than fp32, and more rounds of the same steps
    move a candidate's lead by less than that: after one round, a trial where no candidate is faster
    than fp32 at all is decided (fp32 stays, the choice that is never slower than the plain loop), and
    one where a candidate is ``decisive`` (``DECISIVE``, 1.5x) faster (it wins); after two, one where
    none is ``REACH`` (5%) faster, or where one is ``CLEAR`` (21%) faster and wins.
    """
    reference, *others = times
    if not reference or not others:
        return False
    best = max((min(reference) / min(t) for t in others if t), default=0.0)
    if rounds < 2:
        return best <= 1.0 or best >= decisive
    return best < REACH or best >= CLEAR


def _fails_the_candidate(exc: Exception) -> bool:
    """Whether an exception in a trial step rejects that candidate rather than stopping the trial.

    A kernel missing in a precision, an out-of-memory, and a mistake or bug in the user's model or loss
    (a TaskError from the loss check, or an exception from their code) all do: where fp32 itself fails,
    nothing is measured, and the run meets the same error at step 1, where it is reported with the
    user's line. redline's own errors and bugs pass.
    """
    if isinstance(exc, TaskError):
        return True
    return not isinstance(exc, RedlineError) and blames_user_code(exc)


def _first_line(exc: Exception) -> str:
    text = first_line(exc)
    if isinstance(exc, RuntimeError) and text:  # torch's kernel errors read best as they are
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _with_verdict(reference: Measured, candidate: Measured) -> Measured:
    return dataclasses.replace(candidate, rejected=candidate.rejected or judge(reference, candidate))


def form(precision: str, kernel: str = "auto") -> str:
    """A trial candidate's name: its precision, and the attention kernel its steps prefer where not torch's pick."""
    return precision if kernel == "auto" else f"{precision} with {kernel} attention"


def form_parts(name: str) -> tuple[str, str]:
    """The precision and the attention kernel ("auto": torch's pick) a ``form`` names."""
    precision, _, kernel = name.partition(" with ")
    return precision, kernel.removesuffix(" attention") or "auto"


def copy_model(model: nn.Module) -> nn.Module:
    """Return a deep copy of ``model``, one that torch.nn.utils.prune or weight_norm left a derived weight on too.

    Those keep the weight they compute from their parameters (``weight_orig * weight_mask``) as a plain
    attribute between forwards, a non-leaf tensor that ``copy.deepcopy`` refuses; the copy holds it
    detached, and its own forward pre-hook computes it again from the copied parameters.
    """
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


# -- which candidates, when, and the cache ---------------------------------------------------------


def trial_steps(candidates: Sequence[str], rounds: int = ROUNDS) -> int:
    """The training steps a trial of ``candidates`` in ``rounds`` rounds costs at most, fp32's included (one that
    is decided early costs less: ten steps for one candidate that is slower than fp32 after its first round)."""
    return (WARMUP_STEPS + rounds * (1 + BLOCK)) * (1 + len(candidates))


def trial_key(fingerprint: str, facts: DeviceFacts, batch_size: int, candidates: Sequence[str]) -> str:
    """The cache key of a trial: the workload's fingerprint and everything about this machine that times it."""
    return cache_key(fingerprint, facts, str(batch_size), ",".join(candidates), str(TIMED_STEPS), f"method {METHOD}")


def load_cached(key: str, candidates: Sequence[str], *, kernels: bool = False) -> tuple[list[Measured], str] | None:
    """A cached trial of ``candidates`` and when it was measured, or None: an unreadable entry is measured again, as
    is one naming what no trial of this key times (``_names_asked``: an edit, or a damaged file)."""
    found = read_cache("trials", key)
    try:
        measured = [Measured.from_dict(m) for m in found[0]] if found else None
    except (ValueError, KeyError, TypeError):
        return None
    if not found or not measured or not _names_asked([m.precision for m in measured], candidates, kernels=kernels):
        return None
    return measured, found[1]


def _names_asked(names: Sequence[str], candidates: Sequence[str], *, kernels: bool = False) -> bool:
    """Whether ``names`` are what a trial of ``candidates`` times: fp32 first (the reference), then each candidate, each
    name once; with ``kernels``, forms of them that prefer an attention kernel (``form``), beside the candidate or in
    its place (a kernel picked before the steps: runtime/measure.py)."""
    tail, parts = names[1:], [form_parts(name) for name in names[1:]]
    if names[:1] != ["fp32"] or len(set(tail)) < len(tail) or {p for p, _ in parts} != set(candidates):
        return False
    return all(
        (k == "auto" or (kernels and k in KERNELS)) and form(p, k) == n  # each p a candidate: the set check above
        for n, (p, k) in zip(tail, parts, strict=True)
    )


def store(key: str, measured: Sequence[Measured]) -> None:
    """Cache a trial, atomically; a cache that cannot be written is skipped with a warning."""
    write_cache("trials", key, [m.to_dict() for m in measured])
