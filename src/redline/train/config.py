"""TrainerConfig: how the Trainer runs a Task, as one validated value the CLI derives its flags from."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from redline.config import (
    boolean,
    non_negative_number,
    one_of,
    option,
    positive_int,
    positive_number,
    with_changes,
)
from redline.errors import ConfigError, invalid
from redline.parallel.env import read_env
from redline.runtime.measure import TRIALS, TrialRequest
from redline.runtime.options import RuntimeOptions
from redline.runtime.sampling import check_split
from redline.task import Task
from redline.train.logs import check_logger_names

log = logging.getLogger("redline")

KEEP_CHECKPOINTS = 3
CHECKPOINT_MINUTES = 30.0  # a crash of a long run loses at most this much of it
DEFAULT_LOGGERS = ("csv", "jsonl")  # written when out_dir is set, skipped quietly when it is not (unless named)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The run's length, evaluation, checkpoints and logs, and the Runtime's options (``runtime``)."""

    runtime: RuntimeOptions = option(RuntimeOptions(), "The Runtime's options.", cli=False)
    max_steps: int | None = option(None, "Stop after this many optimizer steps.", min=1)
    max_epochs: int | None = option(None, "Epochs to train (default: the task's own).", flag="--epochs", min=1)
    batch_size: int | None = option(None, "Batch size (default: the task's own).", min=1)
    eval_every: int | None = option(None, "Evaluate every N steps (default: each epoch).", min=1)
    checkpoint_every: int | None = option(None, "Checkpoint every N steps (and at the end).", min=1)
    # None where not given (30 and 3 then): given without out_dir, either would do nothing, and is refused
    checkpoint_minutes: float | None = option(
        None, "Also checkpoint when this many minutes passed since the last one (default: 30; 0: never)."
    )
    keep_checkpoints: int | None = option(None, "Keep the newest K checkpoints (default: 3).", min=1)
    keep_best: Literal["off", "val_loss", "val_metric"] = option(
        "off",
        "Keep the best evaluation's weights in OUT/best.safetensors: off, val_loss (lowest) or val_metric (highest).",
    )
    out_dir: Path | None = option(None, "Write checkpoints, logs, summary.json, model.safetensors.", flag="--out")
    resume: str | None = option(None, "'auto' (the newest valid checkpoint in OUT) or a checkpoint's path.")
    loggers: tuple[str, ...] = option(DEFAULT_LOGGERS, "csv, jsonl or tensorboard; repeatable.", flag="--logger")
    log_every: int = option(50, "Read losses and log every N steps.", min=1)
    progress: bool = option(True, "Show progress on stderr.")
    trial: TrialRequest = option(
        "auto",
        "Time auto's choices on this model first: auto (when the run repays it, its model's earlier short runs here "
        "counted), on (whatever its length), fresh "
        "(as on, measured again in place of a cached measurement) or off.",
    )
    plan: Literal["auto", "tuned"] = option(
        "auto", "auto (a cached tuned Plan if every tuned axis is auto) or tuned (`redline tune`'s, required)."
    )
    memory_history: bool = option(
        False, "On CUDA, record each allocation's stack for the memory snapshot an out-of-memory writes to OUT."
    )
    hang_timeout_s: float | None = option(
        None, "Seconds without progress before a hang report (default: the launcher's --hang-timeout).", cli=False
    )
    hang_start_timeout_s: float | None = option(
        None,
        "Seconds allowed for the set-up and first step before a hang report (default: the launcher's "
        "--hang-start-timeout, else the larger of hang_timeout_s and 600).",
        cli=False,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.runtime, RuntimeOptions):
            raise invalid("runtime", type(self.runtime).__name__, "a RuntimeOptions")
        for name in ("max_steps", "max_epochs", "batch_size", "eval_every", "checkpoint_every"):
            positive_int(name, getattr(self, name), optional=True)
        if self.keep_checkpoints is not None:
            positive_int("keep_checkpoints", self.keep_checkpoints)
        if self.checkpoint_minutes is not None:
            non_negative_number("checkpoint_minutes", self.checkpoint_minutes)
        positive_int("log_every", self.log_every)
        positive_number("hang_timeout_s", self.hang_timeout_s, optional=True)
        positive_number("hang_start_timeout_s", self.hang_start_timeout_s, optional=True)
        # a value's own mistake first: said only once --out is added, a typo would wait for a second try
        boolean("progress", self.progress)
        boolean("memory_history", self.memory_history)
        one_of("trial", self.trial, TRIALS)
        one_of("plan", self.plan, ("auto", "tuned"))
        one_of("keep_best", self.keep_best, ("off", "val_loss", "val_metric"))
        # "~" is the shell's: a quoted one, or --out=~/x, would otherwise make a directory named "~"
        if self.out_dir is not None:  # "" would write the whole run into the current folder
            _named_path("out_dir", self.out_dir, "a folder's path, not an empty one")
            object.__setattr__(self, "out_dir", Path(os.path.expanduser(self.out_dir)))  # ~nosuchuser stays
        if self.resume is not None:  # "" would resume from the current folder
            _named_path("resume", self.resume, "'auto' or a checkpoint's path, not an empty one")
            object.__setattr__(self, "resume", os.path.expanduser(self.resume))
        if self.out_dir is None:  # asked for, these would do nothing unnoticed: nowhere to write or read
            needs_out_dir = {
                "resume": (self.resume == "auto", "'auto' looks for the checkpoints in DIR/checkpoints"),
                "checkpoint_every": (self.checkpoint_every is not None, "the checkpoints are written in DIR"),
                "keep_checkpoints": (self.keep_checkpoints is not None, "it counts the checkpoints in DIR"),
                "checkpoint_minutes": (self.checkpoint_minutes is not None, "the checkpoints go in DIR"),
                "keep_best": (self.keep_best != "off", "the best weights are written to DIR/best.safetensors"),
                "memory_history": (self.memory_history is True, "an out-of-memory writes its snapshot in DIR"),
            }
            for name, (asked, why) in needs_out_dir.items():
                if asked:
                    raise invalid(name, getattr(self, name), f"it with out_dir=DIR: {why}", "add out_dir=DIR")
        loggers = (self.loggers,) if isinstance(self.loggers, str) else tuple(self.loggers)
        check_logger_names(loggers, field="loggers")
        object.__setattr__(self, "loggers", loggers)
        # asked for by name (any set but the default's): writing nothing would go unnoticed
        named = list(loggers) if set(loggers) != set(DEFAULT_LOGGERS) else []
        chosen = [name for name in named if name not in DEFAULT_LOGGERS] or named
        if chosen and self.out_dir is None:
            raise ConfigError(
                f"logger {chosen[0]!r} writes its files under out_dir, and out_dir is None; expected an out_dir "
                f"with it\nhint: pass --out DIR (out_dir=... in Python), or drop --logger {chosen[0]}"
            )

    @property
    def checkpoints_kept(self) -> int:
        """How many checkpoints the run keeps: ``keep_checkpoints``, else 3."""
        return KEEP_CHECKPOINTS if self.keep_checkpoints is None else self.keep_checkpoints

    @property
    def checkpoint_period_minutes(self) -> float:
        """The minutes after which a checkpoint is written whatever the steps: ``checkpoint_minutes``, else 30."""
        return CHECKPOINT_MINUTES if self.checkpoint_minutes is None else self.checkpoint_minutes

    def epochs_for(self, task: Task) -> float:
        """The epochs a run of ``task`` plans: --epochs, else unbounded where --max-steps alone decides the length,
        else the task's own."""
        return self.max_epochs or (math.inf if self.max_steps else task.epochs)

    def check_task(self, task: Task) -> None:
        """Refuse what would do nothing unnoticed for this task: evaluating every N steps, or keeping the best
        evaluation's weights, without val_data; keeping the best val_metric without a metric. A metric
        without val_data, never computed, is a warning: a task's val_data is often left out on purpose."""
        if task.metric is not None and task.val_data is None:
            log.warning("task %r has a metric but no val_data: no metric is computed (give it val_data=...)", task.name)
        for name, asked in (("eval_every", self.eval_every is not None), ("keep_best", self.keep_best != "off")):
            if asked and task.val_data is None:
                raise invalid(
                    name, getattr(self, name), f"it with a task that has val_data (task {task.name!r} has none)",
                    "drop it, or give the task val_data=...",
                )  # fmt: skip
        if self.batch_size is None:  # the task's own, named as such (in each launched worker: a launcher runs no task)
            check_split(task.batch_size, read_env().world_size, task=task.name)
        if self.keep_best == "val_metric" and task.metric is None:
            raise invalid(
                "keep_best", self.keep_best, f"val_loss: task {task.name!r} has no metric, so its evaluation "
                "reports val_loss alone",
                "pass keep_best='val_loss', or give the task metric=...",
            )  # fmt: skip

    @classmethod
    def build(cls, config: TrainerConfig | None = None, **changes: Any) -> TrainerConfig:
        """Return ``config`` (or the defaults) with ``changes``; an unknown name is a clear error."""
        runtime = sorted(set(changes) & _RUNTIME_FIELDS)
        hint = f"{runtime[0]} is a Runtime option: pass runtime=RuntimeOptions(...)" if runtime else ""
        return with_changes(cls, config, changes, what="a Trainer option", hint=hint)


_RUNTIME_FIELDS = {f.name for f in fields(RuntimeOptions) if not f.metadata.get("internal")}  # the user's options


def _named_path(name: str, value: object, allowed: str) -> None:
    """Refuse a path field's ``value`` that names no path: an empty or blank one, or no str or path at all."""
    if not isinstance(value, str | os.PathLike):  # a number, say: no path at all, not an empty one
        kind = type(value).__name__
        raise invalid(
            name, value, allowed.replace(", not an empty one", ""), f"pass a str or a Path (this is of type {kind})"
        )
    given = os.fspath(value)
    if not isinstance(given, str) or not given.strip():
        raise invalid(name, value, allowed, "name it; an empty value is often a shell variable that is not set")
