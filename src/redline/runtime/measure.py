"""Measuring the Runtime's "auto" precision on the Task's own model before a run.

The rule of thumb (plan/precision.py) proposes; a trial (runtime/trial.py) decides, when the run
is long enough to repay it: a trial of r rounds costs at most ``trial_steps(candidates, r)``
training steps, and runs with as many rounds (four at most) as keep that within a ``REPAY``-th of
the planned run; where not even ``LEAST_ROUNDS`` (three) fit, it does not run. A Trainer's run too short for one
counts its steps toward the workload's runs on this machine (``RUNS``): once they add up to what repays a trial, the
next run that is no shorter than the trial itself measures, so a sweep of short runs of one model is measured once.
Where the attention kernel is left to
auto, each reduced precision is timed with each kernel that takes the model's calls too, or, where the run does not
repay those steps, on the one kernel its calls ran fastest on alone (``picked_forms``). Its result is cached on disk,
keyed by the Task's fingerprint and this machine, so a second run pays nothing, a short one included.
Under several processes rank 0 measures and every rank runs its choice.

Whatever the trial did, the choice it hands the Runtime is final: the Runtime checks on the run's own steps
only a precision no trial was asked about (runtime/precision_check.py), so a Trainer's run takes the same
precision from its first step to its last, and one resumed from a checkpoint goes on exactly as it would have.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch.utils.data import DataLoader

from redline.hardware.contention import Sampler
from redline.parallel.collectives import run_on_rank0
from redline.parallel.env import DistEnv
from redline.plan import Choice
from redline.plan.optimizer import resolve_zero_grad
from redline.plan.precision import resolve_precision, resolve_tf32
from redline.runtime.attention import model_attention
from redline.runtime.cache import read_cache, write_cache
from redline.runtime.contract import split_batch
from redline.runtime.fused import as_the_run_steps
from redline.runtime.loading import read_batches
from redline.runtime.optimizer import check_trainable
from redline.runtime.options import RuntimeOptions
from redline.runtime.precision import half_model_keeps_fp32
from redline.runtime.seed import capture_rng, restore_rng
from redline.runtime.settings import ProcessSettings
from redline.runtime.trial import (
    ROUNDS,
    Measured,
    choose,
    load_cached,
    run_trial,
    store,
    trial_key,
    trial_steps,
)
from redline.runtime.workload import FINGERPRINT_HINT as FINGERPRINT_HINT  # the Trainer's, for its own build
from redline.runtime.workload import Workload, fingerprint_of, workload
from redline.task import Task

log = logging.getLogger("redline")
# auto: measure where the run repays it, else take a cached measurement; on: measure whatever the run's length (a
# cached measurement still answers); fresh: as on, in place of a cached one (a busy machine's is not pinned); off.
TrialRequest = Literal["auto", "on", "off", "fresh"]
TRIALS: tuple[str, ...] = get_args(TrialRequest)
REPAY = 10  # a trial's rounds are as many as keep its steps within this share of the planned run: <= 10%
# The fewest rounds a trial runs: one round can only keep fp32; at two, a trial that finds nothing (about 12 of the
# run's steps for one candidate) would cost a run of 180 steps 7%, more than the whole-trial rule ever let it cost.
LEAST_ROUNDS = 3
NOT_MEASURED = "not measured:"  # in a choice's reason where no trial was run nor read (the rule's, and why)
PICKED = "trial-kernels"  # the cache's kind that keeps, beside a trial, how ``picked_forms`` picked its kernels
RUNS = "trial-runs"  # the cache's kind that keeps the planned steps of a workload's runs that did not measure
BUSY = "trial-busy"  # the cache's kind that keeps, beside a trial measured while other work took its CPUs, the note
INSIST = "--trial on measures anyway"  # how a command measures a run too short to repay a trial, by default
CACHED = "; cached from "  # in a choice's reason where the trial was read from the cache, not run


def measure_auto(
    task: Task,
    options: RuntimeOptions,
    batch_size: int,
    planned_steps: float,
    env: DistEnv,
    *,
    trial: str,
    insist: str = INSIST,
) -> dict[str, Choice[str]]:
    """The "auto" choices a trial measured for this run (``{"precision": ...}``: the rule's where it did not
    measure, with why; and ``"attention"`` where it timed the kernels too), or {} where none applies.

    ``trial`` is a ``TrialRequest``: "auto" (measure when the run repays it), "on", "fresh" (measured again, the
    cached measurement replaced) or "off"; ``insist`` tells, in the reason of a run too short to repay a trial, how
    the command at hand would measure anyway. Under "auto" the steps of the workload's earlier runs here that did not
    measure count toward repaying a trial (a bench reads them, as the run it stands for would; ``measure_run`` adds a
    run's own).
    """
    return _measured(task, options, batch_size, planned_steps, env, trial=trial, insist=insist, counts=False)[0]


def measure_run(
    task: Task, options: RuntimeOptions, batch_size: int, planned_steps: float, env: DistEnv, *, trial: str
) -> tuple[dict[str, Choice[str]], float | None]:
    """``measure_auto`` for a Trainer's run, whose steps, where it does not measure, count toward its workload's later
    runs; and the seconds its trial took where one ran (None where it read the cache, or none ran)."""
    return _measured(task, options, batch_size, planned_steps, env, trial=trial, counts=True)


def _measured(
    task: Task,
    options: RuntimeOptions,
    batch_size: int,
    planned_steps: float,
    env: DistEnv,
    *,
    trial: str,
    counts: bool,
    insist: str = INSIST,
) -> tuple[dict[str, Choice[str]], float | None]:
    work = workload(task, options, batch_size, env)
    if work is None:
        return {}, None  # a precision given, or none worth trying here: the rule's reason says why
    rule = resolve_precision("auto", work.facts)
    if trial == "off":
        return {"precision": Choice(rule.value, f"{rule.reason}; {NOT_MEASURED} the trial is off")}, None

    def trial_on_rank0() -> tuple[str, str, bool, float | None]:
        keys = _keys(task, work)
        earlier = earlier_steps(keys.runs) if trial == "auto" else 0.0

        def rounds_for(names: Sequence[str]) -> int:  # a trial of these candidates: as many rounds as the runs repay
            return repaid_rounds(names, planned_steps, earlier) if trial == "auto" else ROUNDS

        short = rounds_for(work.candidates) < LEAST_ROUNDS  # too short to repay a trial, not a cached one
        found = _measure(task, work, keys, short, rounds_for, fresh=trial == "fresh")
        if found is None:
            if counts:
                write_cache(RUNS, keys.runs, [earlier + planned_steps])
            why = unrepaid(work.candidates, planned_steps, earlier, counted=counts)
            return rule.value, f"{rule.reason}; {NOT_MEASURED} {why} ({insist})", False, None
        chosen = found.choice
        if trial == "auto" and found.seconds is not None and repaid_rounds(work.candidates, planned_steps) == 0:
            runs = f"{earlier + planned_steps:g} steps with the earlier ones' {earlier:g}"
            paid = f"; measured by this run of {planned_steps:g} steps, as this workload's runs here add up to {runs}"
            chosen = Choice(chosen.value, chosen.reason + paid)
        return chosen.value, chosen.reason, found.kernels, found.seconds

    value, reason, kernels, seconds = run_on_rank0(trial_on_rank0, "the precision trial")  # rank 0's, on all; its
    return work.choices(Choice(value, reason), kernels=kernels), seconds  # failure stops all


def repaid_rounds(candidates: Sequence[Any], planned_steps: float, earlier: float = 0.0) -> int:
    """The most rounds (``ROUNDS`` at most) of a trial whose steps stay within a ``REPAY``-th of the planned run and
    the ``earlier`` steps of the workload's runs here that did not measure, and within the planned run itself (a run
    of 30 steps does not pay for a trial of 26); 0 where even ``LEAST_ROUNDS`` would not."""
    fits = [
        r for r in range(LEAST_ROUNDS, ROUNDS + 1)
        if REPAY * trial_steps(candidates, r) <= planned_steps + earlier and trial_steps(candidates, r) <= planned_steps
    ]  # fmt: skip
    return max(fits, default=0)


def unrepaid(candidates: Sequence[Any], planned_steps: float, earlier: float, *, counted: bool) -> str:
    """Why a run of ``planned_steps`` does not measure ``candidates`` (``earlier``: the steps of the workload's runs
    here that did not measure either; ``counted``: whether this run's are added to them), and which run will."""
    cost = trial_steps(candidates, LEAST_ROUNDS)
    repays = REPAY * cost
    if planned_steps < cost:
        why = f"a trial costs {cost} steps or more, more than this run of {planned_steps:g}"
    else:
        why = f"a trial costs {cost} steps or more, which a run of {repays} repays, not this one of {planned_steps:g}"
        why += f" with the earlier runs' {earlier:g} of this workload here" if earlier else ""
    if not counted:
        return why
    total = earlier + planned_steps
    if total >= repays:
        return f"{why}; this workload's runs here add up to {total:g} steps: its next of {cost} steps or more measures"
    return f"{why}; this workload's next run here to bring them to {repays}, of {cost} steps or more, measures"


def earlier_steps(key: str) -> float:
    """The planned steps of the runs of a workload (``key``: its ``_Keys.runs``) here that did not measure."""
    found = read_cache(RUNS, key)
    try:
        steps = float(found[0][0]) if found else 0.0
    except (IndexError, TypeError, ValueError):  # an unreadable tally counts nothing: a run's own steps start it again
        return 0.0
    return steps if math.isfinite(steps) and steps > 0 else 0.0


def recall_auto(task: Task, options: RuntimeOptions, batch_size: int, env: DistEnv) -> dict[str, Choice[str]]:
    """The "auto" choices a trial cached for this run (as ``measure_auto`` would read them: ``"precision"``, and
    ``"attention"`` where it timed the kernels), else {}: a reader that must not run steps (an estimate of memory,
    made before the step is known to fit) takes no more."""
    work = workload(task, options, batch_size, env)
    found = _measure(task, work, _keys(task, work), True, lambda names: ROUNDS) if work is not None else None
    return work.choices(found.choice, kernels=found.kernels) if work is not None and found is not None else {}


class Found(NamedTuple):
    """A trial's choice of form, whether it timed attention kernels, and its seconds where it ran (not the cache's)."""

    choice: Choice[str]
    kernels: bool
    seconds: float | None = None


@dataclass(frozen=True)
class _Keys:
    """Where a workload's trial is cached: timed with the attention kernels, or plain (the kernel the run asks for),
    and the tally of its runs that did not measure (``RUNS``)."""

    with_kernels: str
    plain: str
    runs: str


def _keys(task: Task, work: Workload) -> _Keys:
    facts, local_batch = work.facts, work.local_batch
    parts = [*work.candidates, f"layout {work.channels_last}", f"NCHW fallback {work.fallback}"]
    parts += ["optimizer as given"] if work.sharded or work.deterministic else []  # the copies step it so (fused.py)
    fingerprint = fingerprint_of(task)
    plain = [*parts, f"attention {work.attention}"]
    return _Keys(
        with_kernels=trial_key(fingerprint, facts, local_batch, [*parts, "attention kernels timed"]),
        plain=trial_key(fingerprint, facts, local_batch, plain),
        runs=trial_key(fingerprint, facts, local_batch, [*plain, "runs"]),
    )


def _measure(
    task: Task,
    work: Workload,
    keys: _Keys,
    recall_only: bool,
    rounds_for: Callable[[Sequence[str]], int],
    *,
    fresh: bool = False,
) -> Found | None:
    """Time fp32 and the candidates on the task's model and first batch, in ``rounds_for(candidates)`` rounds at most
    (or read the cache, but with ``fresh``); return the choice. With ``recall_only``, only read the cache: None when
    it holds no measurement of this workload.

    A model factory draws weights (for the fingerprint and the trial) and the batch is drawn too:
    the run's random streams are put back as they were.
    """
    saved = capture_rng()
    try:
        return _measure_or_recall(task, work, keys, recall_only, rounds_for, fresh)
    finally:
        restore_rng(saved)


def _measure_or_recall(
    task: Task,
    work: Workload,
    keys: _Keys,
    recall_only: bool,
    rounds_for: Callable[[Sequence[str]], int],
    fresh: bool,
) -> Found | None:
    """As ``_measure``. Where the attention kernel is left to auto, the kernels are looked for (and timed) only when a
    trial is about to run, and the run repays a trial of them too; its cache entry, kernels and all (or none found),
    is read first, so a later run looks for nothing. A kernel named is preferred in every step timed. ``fresh`` reads
    no cache: the kernels are looked for, as its rounds repay them, and the entry a later run reads first replaced."""
    facts, local_batch = work.facts, work.local_batch
    where = f"this {facts.type.upper() if facts.type == 'cpu' else facts.name}"
    with_kernels, plain = keys.with_kernels, keys.plain
    found = None if fresh else _recall(work, keys, where, busy_too=recall_only)
    if found is not None or recall_only:
        return found
    began = time.perf_counter()
    model = task.build_model()
    kept = half_model_keeps_fp32(model, work.candidates[0], "auto")  # nothing to time: mixed would refuse the model
    if kept is not None:
        return Found(kept, False)
    sampler = Sampler().start() if work.device.type == "cpu" else None  # other work on the CPUs it times
    check_trainable(model)  # as setup refuses it: the trial's optimizer would raise torch's bare error
    loader = DataLoader(task.train_data, batch_size=local_batch, collate_fn=task.collate_fn)
    batch = split_batch(next(read_batches(loader)), "train_data", collate_fn=loader.collate_fn)
    names: list[str] = list(work.candidates)
    key = plain
    calls = model_attention(task, work.device, batch[0]) if work.attention == "auto" else []
    forms = work.kernel_forms(calls) if calls else []
    picking = ""
    if forms and rounds_for([*names, *forms]) >= LEAST_ROUNDS:  # every kernel timed in whole steps
        names, key = [*names, *forms], with_kernels
    elif forms:  # too many for the run to repay: each precision's kernel picked by its attention calls alone
        (names, picking), key = work.picked_forms(calls), with_kernels
    zero_after_step = resolve_zero_grad(facts).value == "after step"  # where the run will free gradients
    kernel = None if work.attention == "auto" else work.attention
    with ProcessSettings(tf32=resolve_tf32(facts).value, attention=kernel).enter():  # fp32 as the run will have it
        stepping = as_the_run_steps(
            task.optimizer, model, facts, sharded=work.sharded, deterministic=work.deterministic
        )  # each copy's optimizer steps as the run's will: fused where its setup would rebuild it so
        measured = run_trial(
            model, stepping, task.loss_fn, batch, work.device, names, zero_after_step=zero_after_step,
            rounds=rounds_for(names), layout=work.layout(model), nchw_fallback=work.fallback,
        )  # fmt: skip
    contention = sampler.stop(torch.get_num_threads()) if sampler is not None else None
    busy = f"; measured while {contention}, so a run that repays a trial measures again" if (
        contention is not None and contention.contended
    ) else ""  # fmt: skip
    if earlier_steps(keys.runs):  # the short runs' steps paid for this trial: a later one is paid for anew
        write_cache(RUNS, keys.runs, [0])
    seconds = time.perf_counter() - began
    reason = unusable(measured)
    if reason:  # nothing cached: the same model with a working loss or learning rate is measured next time
        rule = resolve_precision("auto", facts)
        return Found(Choice(rule.value, f"{rule.reason}; the trial could not measure fp32 ({reason})"), False, seconds)
    _log(measured)
    choice = choose(measured, where)
    if picking:
        choice = Choice(choice.value, f"{choice.reason}; {picking}")
    choice = Choice(choice.value, choice.reason + busy)
    short_of_memory = [m.precision for m in measured if m.out_of_memory]
    if short_of_memory:  # the machine's free memory at the time, not the model's: the next run measures again
        told = f"not cached: {', '.join(short_of_memory)} ran out of memory, which a run with more free may not"
        return Found(Choice(choice.value, f"{choice.reason}; {told}"), key == with_kernels, seconds)
    store(key, measured)
    if key == with_kernels:  # beside it, how each kernel was picked (none: written over an earlier pick's)
        write_cache(PICKED, key, [picking] if picking else [])
    if busy or (contention is not None and read_cache(BUSY, key)):  # a trial known quiet clears a busy one's note
        write_cache(BUSY, key, [busy] if busy else [])
    return Found(choice, key == with_kernels, seconds)


def _recall(work: Workload, keys: _Keys, where: str, *, busy_too: bool) -> Found | None:
    """The trial cached for this workload, with its reason; None where none is, or where the one cached was measured
    on a busy machine (``busy_note``) and not ``busy_too``: a run that repays a trial measures again."""
    kinds = [(keys.with_kernels, True), (keys.plain, False)] if work.attention == "auto" else [(keys.plain, False)]
    for key, kernels in kinds:  # an entry of other precisions than these (edited) is measured anew
        cached = load_cached(key, work.candidates, kernels=kernels)
        if cached is not None and not unusable(cached[0]):  # one an earlier version cached from a diverging fp32: anew
            measured, when = cached
            busy = busy_note(key)
            if busy and not busy_too:
                return None
            choice = choose(measured, where)
            picked = read_cache(PICKED, key) if kernels else None  # how a kernel was picked, where it was so
            told = "".join(f"; {line}" for line in picked[0] if isinstance(line, str)) if picked else ""
            return Found(Choice(choice.value, f"{choice.reason}{told}{busy}{CACHED}{when}"), kernels)
    return None


def busy_note(key: str) -> str:
    """What the reason of a trial cached under ``key`` says of a busy machine ("" where it was measured quiet)."""
    found = read_cache(BUSY, key)
    note = found[0][0] if found and found[0] else ""
    return note if isinstance(note, str) else ""


def unusable(measured: list[Measured]) -> str:
    """Why a trial's numbers cannot decide ("" when they can): fp32, the reference, failed or diverged.

    A candidate is judged against fp32's losses; where fp32's own loss is not finite (a learning rate
    too high, a loss that divides by zero) every candidate would be rejected for the run's fault, and
    that verdict, cached, would outlive the fix (the cache is keyed by the model, not the loss).
    """
    reference = measured[0]
    if reference.rejected or not reference.step_times:
        return reference.rejected or "no step was timed"
    diverged = next((loss for loss in reference.losses if not math.isfinite(loss)), None)
    if diverged is not None:
        return f"its own loss was {diverged}: nothing to compare a candidate with"
    return ""


def _log(measured: list[Measured]) -> None:
    for m in measured:
        log.debug("trial %s: fastest step %.3g ms %s", m.precision, m.step_s * 1e3, m.rejected)
