"""The check that every rank of a launched job was given the same settings.

Each node of a multi-node job runs its own command line. Ranks told to train for different numbers of
steps wait for each other at the end until the backend's timeout (30 minutes for gloo); ranks given
different learning rates train apart without a word. The Trainer compares the settings of every rank
once, at set-up, and refuses to train where they differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from redline.errors import ConfigError
from redline.parallel.collectives import gather_objects
from redline.parallel.env import DistEnv
from redline.runtime.optimizer import group_options
from redline.task import Task, model_fingerprint
from redline.train.config import TrainerConfig

# Settings a host may set for itself: where a shared directory is mounted, what its terminal shows, how many
# cores feed its loader, how long its own watchdog waits. None changes what is trained or when the ranks meet; nor
# does checkpoint_minutes, since the ranks vote on a checkpoint any rank's clock calls for.
_PER_HOST = frozenset({
    "out_dir", "progress", "loggers", "memory_history", "checkpoint_minutes", "hang_timeout_s", "hang_start_timeout_s",
    "runtime.devices", "runtime.loader_workers",
})  # fmt: skip


def settings(config: TrainerConfig, task: Task, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The settings every rank must share, by name: the Trainer's and Runtime's options, the task's, the model's
    structure and the optimizer's hyperparameters (where a --task-arg such as lr= ends up)."""
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "runtime"}
    options |= {f"runtime.{f.name}": getattr(config.runtime, f.name) for f in dataclasses.fields(config.runtime)}
    shared = {name: repr(value) for name, value in options.items() if name not in _PER_HOST}
    shared |= {"task": task.name, "task batch_size": repr(task.batch_size), "task epochs": repr(task.epochs)}
    # not the modules' plain attributes, which a model may set per rank (self.device = f"cuda:{rank}")
    shared["model (structure and shapes)"] = model_fingerprint(model, settings=False)
    groups = group_options(optimizer)
    shared["optimizer"] = f"{type(optimizer).__name__} of {len(groups)} parameter group(s)"
    for index, group in enumerate(groups):
        shared |= {f"the optimizer's {name} (group {index})": repr(value) for name, value in group.items()}
    return shared


def check_ranks_agree(
    config: TrainerConfig, task: Task, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
) -> None:
    """Refuse, on every rank alike, a job whose ranks differ in a setting (``settings``); collective under several
    processes, where every rank calls it. One process has nothing to compare."""
    if not env.distributed:
        return
    every = gather_objects(settings(config, task, model, optimizer))
    for name, first in every[0].items():
        other = next((rank for rank, theirs in enumerate(every) if theirs.get(name) != first), None)
        if other is not None:
            raise ConfigError(
                f"the ranks of this job were given different settings: {name} is {first} on rank 0 and "
                f"{every[other].get(name)} on rank {other}; they would train apart, or wait for each other until "
                "the backend's timeout\nhint: start every node with the same arguments (the same flags and "
                "--task-arg values)"
            )
