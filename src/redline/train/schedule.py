"""The task's LR scheduler, stepped when it expects to be: after every optimizer step, or after every evaluation.

Most schedulers (StepLR, OneCycleLR, CosineAnnealingLR, LambdaLR) step once per optimizer step.
``ReduceLROnPlateau`` steps on a metric instead: the Trainer gives it the validation loss after
each evaluation (``mode="min"``), or the task's metric (``mode="max"``, higher is better), as
Lightning's ``monitor`` does.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from redline.errors import ConfigError, RedlineError, TrainingError, invalid, user_line
from redline.runtime.contract import users_failure
from redline.task import Task

# A scheduler that fails mid-run was most likely sized for a shorter one.
SCHEDULE_HINT = (
    "a schedule sized in steps (OneCycleLR's total_steps, say) must cover the whole run, --max-steps or every "
    "epoch's steps, including a resumed run made longer"
)


class Schedule:
    """The task's scheduler (or none), with the two moments the loop tells it of."""

    def __init__(self, scheduler: Any = None, *, monitor: str = "") -> None:
        self.scheduler = scheduler
        self.monitor = monitor  # the evaluation's metric a plateau scheduler steps on; "" for a per-step one

    @classmethod
    def build(cls, task: Task, optimizer: torch.optim.Optimizer) -> Schedule:
        """Build the task's scheduler on ``optimizer``; refuse one the loop cannot step, naming the fix."""
        if task.scheduler is None:
            return cls()
        try:
            scheduler = task.scheduler(optimizer)
        except RedlineError:
            raise
        except Exception as exc:
            raise TrainingError(
                f"task {task.name!r}: building the scheduler raised {type(exc).__name__}: {exc}{user_line(exc)}"
            ) from exc
        if not all(callable(getattr(scheduler, name, None)) for name in ("step", "state_dict", "load_state_dict")):
            raise invalid(
                "scheduler(optimizer)", type(scheduler).__name__, "an LR scheduler (step, state_dict, load_state_dict)",
                "return the scheduler, e.g. scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)",
            )  # fmt: skip
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            return cls(scheduler, monitor=_plateau_monitor(task, scheduler))
        _check_steps_alone(scheduler)
        return cls(scheduler)

    def after_step(self, step: int) -> None:
        """Step a per-step scheduler after the optimizer's step ``step``; its failure names the step and the fix."""
        if self.scheduler is None or self.monitor:
            return
        with users_failure(f"step {step}: the LR scheduler ({type(self.scheduler).__name__})", SCHEDULE_HINT):
            self.scheduler.step()  # OneCycleLR past its total_steps, say: a run made longer than the schedule

    def after_evaluation(self, metrics: Mapping[str, float | None]) -> None:
        """Step a plateau scheduler on the evaluation's metric."""
        if self.monitor:
            value = metrics.get(self.monitor)
            if value is not None:
                self.scheduler.step(value)

    def state_dict(self) -> dict[str, Any] | None:
        return self.scheduler.state_dict() if self.scheduler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scheduler is not None and state is not None:
            self.scheduler.load_state_dict(state)


def _plateau_monitor(task: Task, scheduler: torch.optim.lr_scheduler.ReduceLROnPlateau) -> str:
    """What a plateau scheduler watches: the validation loss (mode "min") or the task's metric (mode "max")."""
    monitor = "val_metric" if scheduler.mode == "max" else "val_loss"
    if task.val_data is None:
        raise ConfigError(
            "ReduceLROnPlateau steps on a metric, which the Trainer gives it after each evaluation, and the task has "
            "no val_data to evaluate on\nhint: give the task val_data, or use a scheduler that steps on its own "
            "(e.g. torch.optim.lr_scheduler.CosineAnnealingLR)"
        )
    if monitor == "val_metric" and task.metric is None:
        raise ConfigError(
            "ReduceLROnPlateau(mode='max') steps on a metric where higher is better, and the task has no metric\n"
            "hint: give the task a metric (accuracy, say), or use mode='min' to step on the validation loss"
        )
    return monitor


def _check_steps_alone(scheduler: Any) -> None:
    """Refuse a scheduler whose step() needs an argument the loop cannot give it (a metric of the user's own)."""
    try:
        parameters = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):  # a step without a signature to read: let it run
        return
    needed = [p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind in _POSITIONAL]
    if needed:
        raise ConfigError(
            f"{type(scheduler).__name__}.step() needs {', '.join(needed)}, which the Trainer does not know: it steps "
            "a scheduler once per optimizer step with no argument (and ReduceLROnPlateau on the validation loss)\n"
            "hint: use a scheduler that steps on its own, or step this one in a loop of your own with the Runtime"
        )


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
