"""The Trainer's use of a tuned Plan: `--plan tuned` requires one, and auto takes one when it finds it.

`redline tune` caches the settings it measured fastest for a Task on this machine
(runtime/tuned.py). ``--plan tuned`` runs them, and fails with the command that makes them when
there are none; ``--plan auto`` runs them too when every tuned axis was left to auto, so a tuned
machine's later runs gain without asking (``auto_tuned``, the rule the bench's auto row follows
too), and it says so where a flag given keeps the tune out. A tuned micro-batching that would not train the
run as whole batches do is not taken (``whole_where_split_differs``, the bench's rule too). Either way the Plan's
reasons say the values were tuned, when, and by which numbers. A resumed run keeps its stored Plan instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, get_args

import torch

from redline.checkpoint import Checkpoint, load_plan
from redline.errors import ConfigError, RedlineError
from redline.parallel.env import DistEnv
from redline.plan import Choice
from redline.plan.optimizer import OptimizerImpl
from redline.runtime.cache import cache_dir
from redline.runtime.options import RuntimeOptions
from redline.runtime.tuned import MICRO_BATCHES
from redline.runtime.tuned_run import TunedRun, auto_tuned, find_tuned, say_given_over_tune, whole_where_split_differs
from redline.runtime.workload import worker_device
from redline.task import Task
from redline.train.data import plan_length

if TYPE_CHECKING:
    from redline.train.config import TrainerConfig

log = logging.getLogger("redline")
TUNE_COMMAND = "redline tune --task SPEC"  # the command line says SPEC as typed (cli/train.py)


def use_tuned(
    task: Task, options: RuntimeOptions, batch_size: int, env: DistEnv, *, config: TrainerConfig
) -> TunedRun | None:
    """The tuned Plan's settings for this run, or None where none applies (auto without a cached one, or with
    ``--trial on`` or ``fresh``: the user asked auto to measure, and the trial does, in the tune's stead)."""
    epochs, steps = config.epochs_for(task), config.max_steps  # the run's length: a split may leave samples out
    if config.plan == "auto":
        say_given_over_tune(task, options, batch_size, env)
        planned = _planned(task, options, batch_size, env, config)
        found = auto_tuned(task, options, batch_size, env, planned_steps=planned)
        if found is not None and config.trial in ("on", "fresh"):
            if env.is_main:
                log.info("--trial %s: auto measures now instead of running the tuned Plan (%s)", config.trial,
                         found.tuning.note)  # fmt: skip
            return None
        return whole_where_split_differs(task, found, options, batch_size, env, epochs=epochs, max_steps=steps)
    found = find_tuned(task, options, batch_size, env)
    if found is None:
        _, facts = worker_device(options, env)
        devices = f" --devices {options.devices}" if options.devices != "auto" else ""  # the tune runs where asked
        raise ConfigError(
            f"no tuned Plan for task {task.name!r} at batch size {batch_size} on this machine ({facts.name})\n"
            f"hint: run `{TUNE_COMMAND} --batch-size {batch_size}{devices}` first (it caches the Plan under "
            f"{cache_dir()}), or use --plan auto"
        )
    return whole_where_split_differs(task, found, options, batch_size, env, epochs=epochs, max_steps=steps)


def _planned(task: Task, options: RuntimeOptions, batch_size: int, env: DistEnv, config: TrainerConfig) -> float | None:
    """The optimizer steps the run plans, as the Trainer counts them (None where it cannot: it says why next)."""
    try:
        return plan_length(
            task.train_data, batch_size=batch_size, world_size=env.world_size, grad_accum=options.grad_accum,
            max_epochs=config.epochs_for(task), max_steps=config.max_steps, warn=False,
        )[0]  # fmt: skip
    except RedlineError:
        return None


def resumed_batch(found: Checkpoint | None, batch_size: int) -> int:
    """The micro-batch a run resumed from ``found`` continues with: a tuned run split its batch into ``grad_accum``
    parts. A new run (``found`` None) keeps ``batch_size``."""
    accum = load_plan(found).get("grad_accum", {}) if found is not None else {}
    if MICRO_BATCHES in str(accum.get("reason", "")) and "tuned" in str(accum.get("reason", "")):
        return batch_size // int(accum.get("value", 1))
    return batch_size


def resumed_choices(
    found: Checkpoint | None, measured: Mapping[str, Choice[str]] | None, options: RuntimeOptions, env: DistEnv
) -> Mapping[str, Choice[str]] | None:
    """``measured`` for the Runtime of a run resumed from ``found`` (under ``options``, resumed so), with the optimizer
    implementation its checkpoint stepped with (a timing now could choose otherwise, on a busy machine, and the two
    round differently: the resumed run would not end as the unbroken one), where it resumes on the same kind of device
    (a CUDA run's fused kernel, taken by rule, is timed anew on a CPU). A new run takes ``measured`` as it is."""
    plan = load_plan(found) if found is not None else {}
    stored = plan.get("optimizer", {})
    if stored.get("value") not in get_args(OptimizerImpl):  # a Plan of an earlier version without the row
        return measured
    try:
        same = torch.device(str(plan["device"]["value"])).type == worker_device(options, env)[1].type
    except (KeyError, RuntimeError, RedlineError):  # no device row, or one torch cannot read: timed anew
        same = False
    if not same:
        return measured
    return {**(measured or {}), "optimizer": Choice(str(stored["value"]), str(stored.get("reason", "")))}
