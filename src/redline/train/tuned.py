"""The Trainer's use of a tuned Plan: `--plan tuned` requires one, and auto takes one when it finds it.

`redline tune` caches the settings it measured fastest for a Task on this machine
(runtime/tuned.py). ``--plan tuned`` runs them, and fails with the command that makes them when
there are none; ``--plan auto`` runs them too when every tuned axis was left to auto, so a tuned
machine's later runs gain without asking. Either way the Plan's reasons say the values were tuned,
when, and by which numbers. A resumed run keeps its stored Plan instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from redline.errors import ConfigError
from redline.parallel.collectives import gather_objects
from redline.parallel.env import DistEnv
from redline.runtime.measure import worker_device
from redline.runtime.options import RuntimeOptions
from redline.runtime.seed import capture_rng, restore_rng
from redline.runtime.trial import cache_dir
from redline.runtime.tuned import MICRO_BATCHES, TUNED_AXES, TunedPlan, Tuning, load_tuned
from redline.task import Task

PlanRequest = Literal["auto", "tuned"]


@dataclass(frozen=True)
class Tuned:
    """What a tuned Plan changes in a run: its options, its micro-batch, and the reasons for the Plan."""

    options: RuntimeOptions
    batch_size: int
    tuning: Tuning


def use_tuned(task: Task, options: RuntimeOptions, batch_size: int, env: DistEnv, *, plan: str) -> Tuned | None:
    """The tuned Plan's settings for this run, or None where none applies (auto without a cached one)."""
    defaults = RuntimeOptions()
    if plan == "auto" and any(getattr(options, axis) != getattr(defaults, axis) for axis in TUNED_AXES):
        return None  # the user chose some axis: auto does not mix a tune's choices into theirs
    _, facts = worker_device(options, env)
    found = _load(task, facts, batch_size) if env.is_main else None
    data = gather_objects(found and found.to_dict())[0]  # rank 0's, on every rank
    if data is None:
        if plan == "tuned":
            raise ConfigError(
                f"no tuned Plan for task {task.name!r} at batch size {batch_size} on this machine ({facts.name})\n"
                f"hint: run `redline tune --task SPEC` first (it caches the Plan under {cache_dir()}), "
                "or use --plan auto"
            )
        return None
    tuned = TunedPlan.from_dict(data)
    applied = tuned.apply(options)
    micro = batch_size // applied.grad_accum if applied.grad_accum != options.grad_accum else batch_size
    note = f"tuned {tuned.measured_at} for {tuned.planned_steps} steps"
    return Tuned(applied, micro, Tuning(tuned.plan_reasons(applied), note))


def resumed_batch(plan: Mapping[str, Mapping[str, Any]], batch_size: int) -> int:
    """The micro-batch a resumed run continues with: a tuned run split its batch into ``grad_accum`` parts."""
    accum = plan.get("grad_accum", {})
    if MICRO_BATCHES in str(accum.get("reason", "")) and "tuned" in str(accum.get("reason", "")):
        return batch_size // int(accum.get("value", 1))
    return batch_size


def _load(task: Task, facts: Any, batch_size: int) -> TunedPlan | None:
    saved = capture_rng()  # a model factory draws its weights for the fingerprint: the run's streams stay put
    try:
        return load_tuned(task.fingerprint(), facts, batch_size)
    finally:
        restore_rng(saved)
