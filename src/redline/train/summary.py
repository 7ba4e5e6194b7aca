"""TrainSummary: what a training run produced, as data for the terminal, JSON and the report."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from redline.brief import brief
from redline.errors import first_line, user_line
from redline.plan import Plan
from redline.runtime.micro import OomEvent

if TYPE_CHECKING:
    from redline.task import Task
    from redline.train.best import BestWeights
    from redline.train.state import Run


@dataclass(frozen=True, kw_only=True)
class TrainSummary:
    """What a training run produced: the Plan it ran with and the numbers that describe it."""

    task: str
    task_options: dict[str, str] | None  # the --task-arg values the run's Task was loaded with (None: built in Python)
    device: str
    plan: Plan
    steps: int
    epochs: float | None  # None when the data is a stream without a length: an epoch's length is unknown
    samples: int
    final_loss: float | None  # None when no step ran
    val_loss: float | None
    val_metric: float | None
    samples_per_s: float | None  # training steps only, after the first; None when no step ran after it
    tokens_per_s: float | None
    train_seconds: (
        float  # the whole fit, end to end: setting up (the trial too), steps, evaluation, checkpoints, compiles
    )
    trial_seconds: float | None  # the precision trial's where one ran; None where none did, or the cache answered
    eval_seconds: float | None  # spent evaluating (left out of the rates)
    checkpoint_seconds: float | None  # spent writing checkpoints (left out of the rates)
    callback_seconds: float | None  # spent in the callbacks' hooks (left out of the rates)
    compile_seconds: float | None
    flops_per_step: int | None
    mfu: float | None
    mfu_peak_tflops: float | None
    measured_peak_ratio: float | None
    mfu_note: str | None  # why mfu is None (no datasheet peak for the device, an unknown GPU, no step timed)
    skipped_steps: int
    oom_recoveries: list[dict[str, Any]]  # each out-of-memory --micro-batch auto recovered from (step, sizes, where)
    stopped: str
    resumed_from: str | None
    checkpoint: str | None
    best: dict[str, Any] | None  # keep_best's: the monitored metric, its best value, that step, the weights' path
    sample: str | None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainSummary:
        """Read back ``to_dict()``'s data (a run's summary.json); a figure it lacks reads as None."""
        names = {f.name for f in fields(cls)}
        known: dict[str, Any] = {name: data.get(name) for name in names}
        known["plan"] = Plan.from_dict(data.get("plan") or {})
        known["oom_recoveries"] = list(data.get("oom_recoveries") or [])  # absent from older summaries
        return cls(**known)

    def __repr__(self) -> str:
        plan = f"<{len(self.plan.rows())} axes: print(summary.plan)>"
        return brief(self, _BRIEF, plan=plan)

    def to_dict(self) -> dict[str, Any]:
        """Return the summary as JSON-ready data."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["plan"] = self.plan.to_dict()
        return data


_BRIEF = ("task", "device", "steps", "epochs", "final_loss", "val_loss", "val_metric", "samples_per_s", "tokens_per_s",
          "mfu", "train_seconds", "stopped")  # fmt: skip


def recovery(event: OomEvent) -> dict[str, Any]:
    """One out-of-memory recovery as JSON-ready data."""
    data = dataclasses.asdict(event)
    data["snapshot"] = str(event.snapshot) if event.snapshot else None
    return data


log = logging.getLogger("redline")

LOSS_WINDOW = 20  # final_loss averages the last steps' losses: one batch's loss is noisy


def take_sample(task: Task, run: Run) -> str | None:
    """Return what ``task.sample`` makes of the trained model, or None (a task without one, or one that raised: a
    warning says why). Timed as evaluation; every rank samples: under FSDP a forward gathers the weights."""
    if not task.sample:
        return None
    with run.meter.excluded("eval"), run.rt.eager():
        try:
            made = task.sample(run.rt.module)
        except Exception as exc:  # the run trained: its weights and summary are written all the same
            why = f"{type(exc).__name__}: {first_line(exc)}{user_line(exc)}"
            log.warning("task.sample raised %s\nthe summary and final weights are written without it", why)
            return None
    if made is not None and not isinstance(made, str):  # printed and written as text: a number or tensor is not one
        log.warning(
            "task.sample returned a %s, not text; the summary and final weights are written without it\nhint: "
            "return a str from task.sample (str(value), or the decoded text)", type(made).__name__,
        )  # fmt: skip
        return None
    return made


def summarize(
    task: str, run: Run, batches_per_epoch: int | None, sample: str | None, best: BestWeights | None = None
) -> TrainSummary:
    """The summary of a finished ``fit()``: the rates cover training steps only; evaluation, checkpoints and
    the whole run's time stand beside them."""
    rt, pos, metrics = run.rt, run.pos, run.metrics
    figures = run.meter.totals()
    tail = run.losses[-LOSS_WINDOW:]
    return TrainSummary(
        task=task,
        task_options=pos.task_options,
        device=str(rt.device),
        plan=rt.explain(),
        steps=pos.step,
        epochs=round(pos.epoch + pos.batches_in_epoch / batches_per_epoch, 3) if batches_per_epoch else None,
        samples=pos.samples,
        final_loss=sum(tail) / len(tail) if tail else None,
        val_loss=metrics.get("val_loss"),
        val_metric=metrics.get("val_metric"),
        samples_per_s=figures.samples_per_s,
        tokens_per_s=figures.tokens_per_s,
        train_seconds=time.perf_counter() - run.start,
        trial_seconds=run.trial_seconds,
        eval_seconds=run.meter.seconds["eval"],
        checkpoint_seconds=run.meter.seconds["checkpoint"],
        callback_seconds=run.meter.seconds["callbacks"],
        compile_seconds=rt.compile_seconds,
        flops_per_step=figures.flops_per_step,
        mfu=figures.mfu,
        mfu_peak_tflops=figures.peak_tflops,
        measured_peak_ratio=figures.measured_peak_ratio,
        mfu_note=figures.mfu_note,
        skipped_steps=rt.skipped_steps,
        oom_recoveries=[recovery(e) for e in rt.oom_events],
        stopped=run.stopped,
        resumed_from=str(run.resumed.path) if run.resumed else None,
        checkpoint=str(run.last_ckpt.path) if run.last_ckpt else None,
        best=best.to_dict() if best is not None and best.step is not None else None,
        sample=sample,
    )
