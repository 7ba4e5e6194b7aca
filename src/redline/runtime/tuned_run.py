"""What a run takes from a cached tune (runtime/tuned.py): auto's rule for taking one, and the micro-batching a run
refuses.

``auto_tuned`` is the one rule for when "auto" takes a tune, and ``whole_where_split_differs`` the one rule for when
a run of a planned length leaves a tune's micro-batches out: the Trainer's runs and the bench's auto row both ask them,
so the row shows what a run does, and `redline tune` does not offer micro-batches a run would leave out.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from redline.hardware.device import DeviceFacts
from redline.parallel.collectives import run_on_rank0
from redline.parallel.env import DistEnv
from redline.runtime.options import RuntimeOptions
from redline.runtime.sampling import batches_per_epoch, job_size, untrained_batches
from redline.runtime.seed import capture_rng, restore_rng
from redline.runtime.tuned import MICRO_BATCHES, NOT_TAKEN_BUSY, TUNED_AXES, TunedPlan, Tuning, load_tuned
from redline.runtime.workload import fingerprint_of, worker_device
from redline.task import Task
from redline.task.meta import on_meta

log = logging.getLogger("redline")


@dataclass(frozen=True)
class TunedRun:
    """What a tuned Plan changes in a run of a Task: its options, its micro-batch, and the reasons for the Plan."""

    options: RuntimeOptions
    batch_size: int  # per micro-batch: a tuned grad_accum runs the same batch per step as that many parts
    tuning: Tuning
    planned_steps: int = 0  # the run length the tune weighed compile by (0: not known)
    busy: str = ""  # how busy other processes kept the CPUs while the tune searched, where that could skew it


# A run this many times longer or shorter than the one a tune weighed does not take it under plain auto: a compile
# that did not repay 345 steps may repay 100,000, and one that repaid 100,000 costs a 100-step run its whole length.
TUNED_REACH = 2.0


def left_to_auto(options: RuntimeOptions) -> bool:
    """Whether every axis a tune sets was left to auto: else auto does not mix a tune's choices into the user's."""
    return not given_axes(options)


def given_axes(options: RuntimeOptions) -> list[str]:
    """The axes a tune sets that ``options`` give (``--grad-accum 1`` too: a default's value given is given)."""
    return [axis for axis in TUNED_AXES if options.given(axis)]


def say_given_over_tune(task: Task, options: RuntimeOptions, batch_size: int, env: DistEnv) -> None:
    """Say (rank 0, info) that auto leaves a cached tune of ``task`` at ``batch_size`` alone because ``options`` give
    some of the axes it tunes, naming their flags: else a flag given its default's value drops the tune unseen."""
    given = given_axes(options)
    if not given:
        return
    _, facts = worker_device(options, env)

    def note_on_rank0() -> str | None:
        found = _load(task, facts, batch_size)
        return f"tuned {found.measured_at} for {found.planned_steps} steps" if found is not None else None

    note = run_on_rank0(note_on_rank0, "looking up the tuned Plan")
    if note is None or not env.is_main:
        return
    flags = " and ".join(f"--{axis.replace('_', '-')} {_flag_value(getattr(options, axis))}" for axis in given)
    log.info(
        "a tune of task %r is cached (%s), but %s %s given: auto takes a tune only where every axis it tunes is left "
        "to auto, so auto's own rules decide (--plan tuned runs the tune, your flags winning)",
        task.name, note, flags, "was" if len(given) == 1 else "were",
    )  # fmt: skip


def _flag_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def auto_tuned(
    task: Task, options: RuntimeOptions, batch_size: int, env: DistEnv, *, planned_steps: float | None = None
) -> TunedRun | None:
    """What "auto" takes from a tune: the cached tuned Plan's run when every tuned axis was left to auto, else None;
    and None where the run's ``planned_steps`` are more than ``TUNED_REACH`` times the tune's, or less than a
    ``TUNED_REACH``th of them (said once, with how to take the tune anyway)."""
    found = find_tuned(task, options, batch_size, env) if left_to_auto(options) else None
    if found is not None and found.busy:  # its winner may lose on a quiet machine: --plan tuned still runs it
        if env.is_main:
            log.info("a tune of task %r is cached (%s): %s", task.name, found.tuning.note, NOT_TAKEN_BUSY)
        return None
    if found is None or not planned_steps or not found.planned_steps or math.isinf(planned_steps):
        return found
    if 1 / TUNED_REACH <= planned_steps / found.planned_steps <= TUNED_REACH:
        return found
    if env.is_main:
        log.info(
            "a tune of task %r is cached (%s), but this run plans %d steps: auto's own rules decide (--plan tuned "
            "runs the tune anyway; `redline tune --planned-steps %d` weighs one for this run)",
            task.name, found.tuning.note, planned_steps, planned_steps,
        )  # fmt: skip
    return None


def find_tuned(task: Task, options: RuntimeOptions, batch_size: int, env: DistEnv) -> TunedRun | None:
    """The cached tuned Plan of ``task`` at ``batch_size`` on this process's device, applied to ``options``, or None.

    An axis ``options`` sets keeps its value. Rank 0 reads the cache, and every rank runs its answer.
    """
    _, facts = worker_device(options, env)

    def load_on_rank0() -> dict[str, Any] | None:
        found = _load(task, facts, batch_size)
        return found.to_dict() if found is not None else None

    data = run_on_rank0(load_on_rank0, "looking up the tuned Plan")  # rank 0's, on all; its failure stops all
    if data is None:
        return None
    tuned = TunedPlan.from_dict(data)
    applied = tuned.apply(options, facts)
    split = applied.grad_accum != options.grad_accum  # the tune's micro-batches split the batch; a user's add batches
    micro = batch_size // applied.grad_accum if split else batch_size
    reasons = tuned.plan_reasons(applied)
    if not split and options.given("grad_accum"):  # --grad-accum K runs K whole batches a step, the tune's K parts of
        reasons.pop("grad_accum", None)  # one: its reason is not this run's (a tune that kept 1 keeps its own)
    note = f"tuned {tuned.measured_at} for {tuned.planned_steps} steps"
    note += f", {tuned.busy.replace('other processes', 'while other processes')}" if tuned.busy else ""
    found = TunedRun(applied, micro, Tuning(reasons, note), tuned.planned_steps, tuned.busy)
    if split and micro % env.world_size:  # a one-process tune is found by `train --nproc N` too: its key has no threads
        why = f"its micro-batch of {micro} does not split across the {env.world_size} processes"
        return whole_batch(found, options, batch_size, why, env)
    return found


def whole_batch(found: TunedRun, options: RuntimeOptions, batch_size: int, why: str, env: DistEnv) -> TunedRun:
    """``found`` without the tune's micro-batching: each step runs the whole batch of ``batch_size``, as ``options``
    ask (a run that does not take the tune does so too); the Plan's grad_accum row, and an info line, say ``why``."""
    k = found.options.grad_accum
    told = f"the tune's {k} {MICRO_BATCHES} of batch {batch_size} not taken: {why}; each step runs the whole batch"
    if env.is_main:
        log.info("%s: %s", found.tuning.note, told)
    reasons = {**found.tuning.reasons, "grad_accum": {"value": options.grad_accum, "reason": told}}
    applied = dataclasses.replace(found.options, grad_accum=options.grad_accum)
    return dataclasses.replace(found, options=applied, batch_size=batch_size, tuning=Tuning(reasons, found.tuning.note))


def whole_where_split_differs(
    task: Task,
    found: TunedRun | None,
    options: RuntimeOptions,
    batch_size: int,
    env: DistEnv,
    *,
    epochs: float,
    max_steps: int | None,
) -> TunedRun | None:
    """``found``, its micro-batching not taken (``whole_batch``) where a run of ``epochs`` (cut at ``max_steps``) would
    not train split as it trains on whole batches (``split_differs``): `redline train`'s rule, and the bench's auto
    row's."""
    if found is None or found.batch_size == batch_size:  # no split
        return found
    why = split_differs(
        task, batch_size, found.options.grad_accum, env.world_size, epochs=epochs, max_steps=max_steps,
        drop_last=found.options.compile == "on",
    )  # fmt: skip
    return whole_batch(found, options, batch_size, why, env) if why else found


def split_differs(
    task: Task,
    batch_size: int,
    grad_accum: int,
    world_size: int,
    *,
    epochs: float,
    max_steps: int | None,
    drop_last: bool,
) -> str:
    """Why splitting each batch of ``batch_size`` into ``grad_accum`` micro-batches would not train the run as its
    whole batches do ("" where it trains alike: the same samples in each step, each weighing alike): BatchNorm layers
    (their statistics would be a micro-batch's); an epoch that ends in a partial batch, where the run goes past it
    (split, it becomes micro-batches of unequal size, each weighing a step's 1/``grad_accum``, or a micro-batch that
    steps with the next epoch's first, each step then grouping other samples than a whole batch's); or the epochs'
    last micro-batches completing no step. A stream's length is not known: only its model is judged. ``drop_last``:
    the run drops a partial last batch (a compiled one keeps one shape), split or whole."""
    if grad_accum == 1:
        return ""
    micro = batch_size // grad_accum
    norms = batch_norms(task)
    if norms:
        return (
            f"the model's {norms} BatchNorm layer(s) would take their statistics over micro-batches of {micro}, not "
            f"over the batch of {batch_size}"
        )
    size = job_size(task.train_data, world_size)
    if size is None:
        return ""
    rest = size % batch_size
    drop_last = drop_last and size >= batch_size  # a compiled run drops its partial batch where it has a whole one
    whole = batches_per_epoch(size, batch_size, world_size, drop_last=drop_last)
    planned = min(epochs * whole, max_steps if max_steps is not None else math.inf) if whole else 0
    if rest and (rest >= micro or not drop_last) and planned > size // batch_size:
        return (
            f"an epoch of {size} samples ends in a batch of {rest}, not {batch_size}, which micro-batches of {micro} "
            "would step otherwise than the whole batch: in micro-batches of unequal size, each weighing alike, or "
            "together with the next epoch's first"
        )
    if drop_last:  # whole epochs of micro-batches, their partial one dropped as the whole batches drop theirs
        return ""
    per_epoch = batches_per_epoch(size, micro, world_size, drop_last=False)
    left = untrained_batches(per_epoch, grad_accum=grad_accum, max_epochs=epochs, max_steps=max_steps)
    if not left:
        return ""
    return (
        f"{epochs:g} epoch(s) of {per_epoch} micro-batches of {micro} leave the last {left} in no step, untrained, "
        "where the whole batches train on every sample"
    )


def batch_norms(task: Task) -> int:
    """How many BatchNorm layers ``task``'s model has (built on the meta device where it can be, the random streams
    put back): their statistics are over the batch a forward is given."""
    saved = capture_rng()
    try:
        model = on_meta(task.build_model) or task.build_model()
    finally:
        restore_rng(saved)
    return sum(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules())


def _load(task: Task, facts: DeviceFacts, batch_size: int) -> TunedPlan | None:
    saved = capture_rng()  # a model factory draws its weights for the fingerprint: the run's streams stay put
    try:
        return load_tuned(fingerprint_of(task), facts, batch_size)
    finally:
        restore_rng(saved)
