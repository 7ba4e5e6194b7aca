"""Callbacks: small hooks into the Trainer's loop, and early stopping."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from redline.config import call_refused, non_negative_number, one_of, option, positive_int
from redline.errors import ConfigError, TrainingError, invalid
from redline.runtime.contract import users_failure

if TYPE_CHECKING:
    from redline.task import Task
    from redline.train.trainer import Trainer

log = logging.getLogger("redline")


class Callback:
    """Override the hooks you need; each is called with the Trainer and plain values."""

    def on_step(self, trainer: Trainer, step: int, loss: float) -> None:
        """Called at every logging point with the latest step's loss (no extra device sync)."""

    def on_evaluate(self, trainer: Trainer, step: int, metrics: dict[str, float | None]) -> None:
        """Called after each evaluation."""

    def on_checkpoint(self, trainer: Trainer, step: int, path: str) -> None:
        """Called after a checkpoint is committed."""

    def on_fit_end(self, trainer: Trainer, summary: Any) -> None:
        """Called once fit() has its summary."""


@dataclass(kw_only=True)
class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` evaluations (pass it in ``callbacks``).

    ``mode`` "auto" minimises losses and maximises anything else (val_metric is accuracy-like).
    """

    monitor: Literal["val_loss", "val_metric"] = option(
        "val_loss", "The metric early stopping watches (any --early-stopping-* flag turns early stopping on)."
    )
    patience: int = option(3, "Stop after N evaluations without improvement.", min=1)
    min_delta: float = option(0.0, "The least change that counts as an improvement.")
    mode: Literal["auto", "min", "max"] = option("auto", "min, max, or auto (min for losses, max otherwise).")
    best: float | None = field(default=None, init=False)
    bad_evals: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        one_of("early_stopping.monitor", self.monitor, ("val_loss", "val_metric"))
        positive_int("early_stopping.patience", self.patience)
        one_of("early_stopping.mode", self.mode, ("auto", "min", "max"))
        non_negative_number("early_stopping.min_delta", self.min_delta)

    def check_task(self, task: Task) -> None:
        """Refuse, before training, a Task whose evaluation does not report what this watches."""
        if task.val_data is None:
            raise ConfigError(
                f"early stopping watches a validation metric, and task {task.name!r} has no val_data\n"
                "hint: give the Task val_data=..., or drop the early stopping"
            )
        if self.monitor == "val_metric" and task.metric is None:
            raise ConfigError(
                f"early stopping watches val_metric, and task {task.name!r} has no metric: its evaluation reports "
                "val_loss alone\nhint: watch val_loss (--early-stopping-monitor val_loss), or give the Task metric=..."
            )

    @property
    def minimise(self) -> bool:
        return self.mode == "min" or (self.mode == "auto" and self.monitor.endswith("loss"))

    def should_stop(self, metrics: dict[str, float | None]) -> bool:
        """Record an evaluation; return True once patience has run out."""
        value = metrics.get(self.monitor)
        if value is None:
            reported = sorted(name for name, found in metrics.items() if found is not None)
            raise invalid("early_stopping.monitor", self.monitor, f"a metric the evaluation reports: {reported}")
        if math.isnan(value):  # reported, but not a number that can improve
            raise TrainingError(
                f"early stopping watches {self.monitor}, and the evaluation gave {value}\n"
                "hint: the model diverged (lower the learning rate, clip gradients with --clip-grad-norm 1.0) "
                "or task.metric returned NaN"
            )
        sign = -1.0 if self.minimise else 1.0
        if self.best is None or sign * (value - self.best) > self.min_delta:
            self.best, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
        return self.bad_evals >= self.patience

    def reset(self) -> None:
        """Forget the evaluations seen so far: each fit() watches its own run, from its first evaluation."""
        self.best, self.bad_evals = None, 0

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals, "monitor": self.monitor, "minimise": self.minimise}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint's state; one that watched another metric, or the other way, starts afresh."""
        watched = (state.get("monitor", self.monitor), state.get("minimise", self.minimise))  # older: unsaid
        if watched != (self.monitor, self.minimise):  # its best is no value of this metric (a loss is no accuracy)
            self.reset()
            return
        self.best, self.bad_evals = state["best"], int(state["bad_evals"])


def check_callbacks(callbacks: Sequence[Callback] | None, task: Task) -> tuple[list[Callback], EarlyStopping | None]:
    """Return ``callbacks`` (None: none) as a list and the EarlyStopping among them; refuse, before training, what
    the loop could not call (a bare function, an object without every hook: it would fail mid-run), a second
    EarlyStopping, and one watching what ``task``'s evaluation does not report."""
    if callbacks is None:
        return [], None
    if isinstance(callbacks, Callback) or not isinstance(callbacks, Sequence | set | frozenset):
        many = hasattr(callbacks, "__iter__") and not hasattr(callbacks, "on_step")  # a generator of callbacks
        one = all(callable(getattr(callbacks, hook, None)) for hook in _HOOKS)  # one Callback, not in a list
        fix = "callbacks=list(...)" if many else f"callbacks=[{type(callbacks).__name__}(...)]"
        fix = fix if many or one else "callbacks=[MyCallback()], instances of redline.Callback subclasses"
        raise invalid("callbacks", callbacks, "a list of Callback objects", f"pass {fix}")
    for callback in callbacks:
        if isinstance(callback, type):  # its hooks are plain functions, callable, but without self: mid-run TypeErrors
            raise invalid(
                "callbacks", list(callbacks), f"Callback objects; one is the class {callback.__name__} itself",
                f"pass an instance: callbacks=[{callback.__name__}()]",
            )  # fmt: skip
        missing = [hook for hook in _HOOKS if not callable(getattr(callback, hook, None))]
        if missing:  # a Callback has every hook; an object of the user's own may too
            raise invalid(
                "callbacks", list(callbacks),
                f"Callback objects; one is {type(callback).__name__}, with no {', '.join(missing)}",
                "subclass redline.Callback and override the hooks you need (on_step, on_evaluate, on_checkpoint, "
                "on_fit_end); the others do nothing",
            )  # fmt: skip
        for hook, params in _HOOKS.items():  # a hook that cannot take what the loop gives would fail mid-run
            if why := call_refused(getattr(callback, hook), len(params)):
                raise invalid(
                    "callbacks", list(callbacks),
                    f"hooks that take what the loop gives; {type(callback).__name__}.{hook}: {why}",
                    f"define it as def {hook}(self, {', '.join(params)})",
                )  # fmt: skip
    stoppers = [c for c in callbacks if isinstance(c, EarlyStopping)]
    if len(stoppers) > 1:
        raise ConfigError("callbacks hold more than one EarlyStopping\nhint: pass one, watching one metric")
    for stopper in stoppers:
        stopper.check_task(task)
    return list(callbacks), stoppers[0] if stoppers else None


def warn_if_stopping_cannot_act(
    stopping: EarlyStopping | None,
    total: float,
    batches_per_epoch: int | None,
    *,
    eval_every: int | None,
    grad_accum: int,
) -> None:
    """Warn where a new run of ``total`` steps evaluates too seldom before its last step for ``stopping`` to end it
    (a first best, then ``patience`` evaluations without improvement). It evaluates every ``eval_every`` steps, else
    at each epoch's end (of ``batches_per_epoch``; None: a stream, whose epochs' ends are not known before)."""
    if stopping is None or math.isinf(total):
        return
    if eval_every:
        when, count = f"every {eval_every} steps", (int(total) - 1) // eval_every
    elif batches_per_epoch:
        batches = int(total) * grad_accum  # the Runtime counts micro-batches across an epoch's end
        when, count = f"at each epoch's end ({batches_per_epoch} batches)", (batches - 1) // batches_per_epoch
    else:
        return
    if count > stopping.patience:
        return
    log.warning(
        "early stopping with patience %d needs %d evaluations before the run's last step to end it, and this run "
        "evaluates %s: %d before step %d, so it runs to the end\nhint: evaluate more often (--eval-every N; "
        "eval_every=N in Python), train longer, or lower the patience (--early-stopping-patience)",
        stopping.patience, stopping.patience + 1, when, count, int(total),
    )  # fmt: skip


# Each hook and what the loop gives it.
_HOOKS = {
    "on_step": ("trainer", "step", "loss"),
    "on_evaluate": ("trainer", "step", "metrics"),
    "on_checkpoint": ("trainer", "step", "path"),
    "on_fit_end": ("trainer", "summary"),
}


def call_hooks(callbacks: Sequence[Callback], hook: str, *args: Any) -> None:
    """Call ``hook`` of each callback; one that raises is a TrainingError naming the callback, the hook and the
    user's line (a redline error, or a bug of redline's, passes as it is)."""
    for callback in callbacks:
        with users_failure(f"callback {type(callback).__name__}.{hook}", "fix the callback: the run stopped there"):
            getattr(callback, hook)(*args)
