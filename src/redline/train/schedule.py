"""The task's LR scheduler, stepped when it expects to be: after every optimizer step, or after every evaluation.

Most schedulers (StepLR, OneCycleLR, CosineAnnealingLR, LambdaLR) step once per optimizer step.
``ReduceLROnPlateau`` steps on a metric instead: the Trainer gives it the validation loss after
each evaluation (``mode="min"``), or the task's metric (``mode="max"``, higher is better), as
Lightning's ``monitor`` does.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from redline.errors import ConfigError, RedlineError, TrainingError, invalid, user_line
from redline.runtime.contract import users_failure
from redline.task import Task

log = logging.getLogger("redline")

# A scheduler that fails mid-run was most likely sized for a shorter one.
SCHEDULE_HINT = (
    "a schedule sized in steps (OneCycleLR's total_steps, say) must cover the whole run, --max-steps or every "
    "epoch's steps; a resumed run follows the schedule its task builds now, so to make a run longer, resume with "
    "the schedule sized for the new length (a --task-arg its scheduler reads)"
)

# A scheduler's state entries that say how far it has come, not how it was built: a resumed run takes them from the
# checkpoint. (CosineAnnealingWarmRestarts' T_cur and T_i; ReduceLROnPlateau's best and the evaluations since.)
PROGRESS = frozenset(
    {"last_epoch", "_step_count", "_last_lr", "_is_initial", "_get_lr_called_within_step", "T_cur", "T_i", "best"}
    | {"num_bad_epochs", "cooldown_counter"}
)


class Schedule:
    """The task's scheduler (or none), with the two moments the loop tells it of."""

    def __init__(self, scheduler: Any = None, *, monitor: str = "", rebuild: Callable[[], Any] | None = None) -> None:
        self.scheduler = scheduler
        self.monitor = monitor  # the evaluation's metric a plateau scheduler steps on; "" for a per-step one
        self.rebuild = rebuild  # builds the task's scheduler again, on the same optimizer

    @classmethod
    def build(cls, task: Task, optimizer: torch.optim.Optimizer) -> Schedule:
        """Build the task's scheduler on ``optimizer``; refuse one the loop cannot step, naming the fix."""
        if task.scheduler is None:
            return cls()
        scheduler = _built(task, optimizer)
        if not all(callable(getattr(scheduler, name, None)) for name in ("step", "state_dict", "load_state_dict")):
            raise invalid(
                "scheduler(optimizer)", type(scheduler).__name__, "an LR scheduler (step, state_dict, load_state_dict)",
                "return the scheduler, e.g. scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)",
            )  # fmt: skip
        rebuild = functools.partial(_built, task, optimizer)
        if isinstance(scheduler, ReduceLROnPlateau):
            return cls(scheduler, monitor=_plateau_monitor(task, scheduler), rebuild=rebuild)
        _check_steps_alone(scheduler)
        return cls(scheduler, rebuild=rebuild)

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

    def load_state_dict(
        self, state: dict[str, Any] | None, *, steps: int = 0, source: str = "the checkpoint", warn: bool = True
    ) -> None:
        """Load the schedule ``state`` of a checkpoint (``source``) written ``steps`` steps into the run, after its
        optimizer: its progress, with this run's settings (``warn``: name those that changed).

        A torch scheduler is built again as the run began (at the checkpoint's initial learning rates) and compared:
        with the same settings it loads the state as it was saved; with others (a longer T_max or total_steps for a
        run resumed longer), a per-step schedule is stepped ``steps`` times, to where it would be had the run begun
        with them (a cosine's learning rate follows from the last, so a loaded one would go on from the old
        schedule's), and a plateau keeps its progress (its best loss, the evaluations since) under the new settings.
        """
        if self.scheduler is None or state is None:
            return
        if self.rebuild is None or not isinstance(self.scheduler, LRScheduler | ReduceLROnPlateau):
            self.scheduler.load_state_dict(state)  # a scheduler of another kind: its state is its own to read
            return
        optimizer = self.scheduler.optimizer
        loaded = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        for group in optimizer.param_groups:  # as the run began: at its initial rates (a schedule moved them since)
            group["lr"] = group.get("initial_lr", group["lr"])
        self.scheduler = self.rebuild()
        changed = changed_settings(self.scheduler.state_dict(), state) + _lambda_changes(self.scheduler, state)
        if changed and warn:
            log.warning(
                "%s: this run's LR scheduler (%s) has %s; the resumed run follows this run's, as if it had begun "
                "with them\nhint: to go on with the checkpoint's, resume with the task (and --task-arg options) "
                "the run began with", source, type(self.scheduler).__name__, "; ".join(changed),
            )  # fmt: skip
        if changed and not self.monitor:
            self._replay(steps, source)
            return
        for group, before in zip(optimizer.param_groups, loaded, strict=True):  # the rates the checkpoint holds
            for key in set(group) - set(before) - {"params"}:
                del group[key]
            group.update(before)
        kept = state if not changed else {**self.scheduler.state_dict(), **_progress(state, self.scheduler)}
        self.scheduler.load_state_dict(kept)

    def _replay(self, steps: int, source: str) -> None:
        """Step the rebuilt scheduler ``steps`` times: where it would be after as many optimizer steps."""
        name = type(self.scheduler).__name__
        with (
            users_failure(f"{source}: the LR scheduler ({name}) stepped to step {steps}", SCHEDULE_HINT),
            warnings.catch_warnings(),
        ):
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            for _ in range(steps):
                self.scheduler.step()


def changed_settings(now: Mapping[str, Any], kept: Mapping[str, Any], where: str = "") -> list[str]:
    """The settings of scheduler state ``now`` that differ from the checkpoint's (``kept``), each as "T_max 20, the
    checkpoint's 10" (a chained or sequential scheduler's own schedulers' by number); the progress entries left out,
    and entries derived from a named setting (OneCycleLR's _schedule_phases, of total_steps) named alone where none
    is."""
    changed: list[str] = []
    derived: list[str] = []
    for key in sorted(set(now) | set(kept), key=str):
        if key in PROGRESS:
            continue
        if key == "_schedulers" and len(now.get(key) or ()) == len(kept.get(key) or ()):
            for i, (inner, before) in enumerate(zip(now[key], kept[key], strict=True)):
                changed += changed_settings(inner, before, f"{where}scheduler {i}'s ")
            continue
        if not _same(now.get(key), kept.get(key)):
            said = f"{where}{key} {now.get(key, 'none')}, the checkpoint's {kept.get(key, 'none')}"
            (derived if str(key).startswith("_") else changed).append(said)
    return changed or derived


def _lambda_changes(scheduler: Any, state: Mapping[str, Any]) -> list[str]:
    """A LambdaLR's functions are not in its state: where those built now give another rate at the checkpoint's step
    (a warmup-and-decay sized for a longer run), said as "lr_lambdas give lr 0.06 at step 8, the checkpoint's 0.02"."""
    if not isinstance(scheduler, LambdaLR) or not {"base_lrs", "last_epoch", "_last_lr"} <= state.keys():
        return []
    step = state["last_epoch"]
    now = [base * rate(step) for base, rate in zip(state["base_lrs"], scheduler.lr_lambdas, strict=False)]
    if _same(now, state["_last_lr"]):
        return []
    shown = ", ".join(f"{r:.4g}" for r in now), ", ".join(f"{r:.4g}" for r in state["_last_lr"])
    return [f"lr_lambdas give lr {shown[0]} at step {step}, the checkpoint's {shown[1]}"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # a value that does not compare (an array's ==): different is the safe answer
        return False


def _progress(state: Mapping[str, Any], scheduler: Any) -> dict[str, Any]:
    """A plateau's progress entries of checkpoint ``state``; its verdicts (best, the evaluations since) only where
    it watches the same way (mode), since they are relative to it."""
    same_mode = state.get("mode") == getattr(scheduler, "mode", None)
    judged = {"best", "num_bad_epochs"}
    return {k: v for k, v in state.items() if k in PROGRESS and (same_mode or k not in judged)}


def _built(task: Task, optimizer: torch.optim.Optimizer) -> Any:
    """The task's scheduler on ``optimizer``; its failure names the task."""
    assert task.scheduler is not None
    try:
        return task.scheduler(optimizer)
    except RedlineError:
        raise
    except Exception as exc:
        raise TrainingError(
            f"task {task.name!r}: building the scheduler raised {type(exc).__name__}: {exc}{user_line(exc)}"
        ) from exc


def _plateau_monitor(task: Task, scheduler: ReduceLROnPlateau) -> str:
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
