"""Resuming a run: the options it continues under, and the results of one that had already ended."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redline import checkpoint
from redline.checkpoint import Checkpoint, CheckpointError
from redline.checkpoint.loadable import load_safely
from redline.checkpoint.shapes import ModelMismatch
from redline.errors import ConfigError, DeviceUnavailableError
from redline.hardware.device import probe_accelerators
from redline.parallel.collectives import gather_objects
from redline.parallel.env import DistEnv
from redline.plan.device import resolve_device
from redline.runtime.options import RuntimeOptions, same_kind, stored_reason
from redline.train.callbacks import EarlyStopping
from redline.train.config import TrainerConfig
from redline.train.logs import Loggers, open_loggers
from redline.train.output import read_summary
from redline.train.state import Position
from redline.train.summary import TrainSummary

if TYPE_CHECKING:
    from redline.runtime.runtime import Runtime
    from redline.train.best import BestWeights
    from redline.train.schedule import Schedule

log = logging.getLogger("redline")


def resumed_options(options: RuntimeOptions, found: Checkpoint | None, env: DistEnv) -> RuntimeOptions:
    """This run's Runtime options: a resumed run reuses the Plan it was written under."""
    if found is None:
        return options
    plan = checkpoint.load_plan(found)
    overridden = overridden_requests(options, plan)
    if overridden and env.is_main:  # rank 0 speaks for the job
        log.warning(
            "resuming %s under the Plan it was written with: %s\nhint: a resumed run keeps its checkpoint's Plan, "
            "whatever its --out; to train with other settings, start a run without --resume (from step 0); drop "
            "the flag to silence this", found.path, "; ".join(overridden)
        )  # fmt: skip
    resumed = options.with_plan(plan)
    if env.distributed:  # the process group is already on this run's device: keep it
        resumed = dataclasses.replace(resumed, devices=options.devices)
    return resumed if options.devices != "auto" else _available_device(resumed)


def overridden_requests(options: RuntimeOptions, plan: dict[str, dict[str, Any]]) -> list[str]:
    """The options asked for now that a resumed run's stored Plan overrides, each as "asked, kept".

    Only a request other than the default can be told from one left out, so only those are named;
    a switch asked "on" that the stored run had asked for too and could not have ("requested, but
    ...") is no change.
    """
    asked = {
        "precision": (options.precision, "auto"),
        "compile": (options.compile, "auto"),
        "channels_last": (options.channels_last, "auto"),
        "attention": (options.attention, "auto"),
        "grad_accum": (options.grad_accum, 1),
        "clip_grad_norm": (options.clip_grad_norm, None),
        "seed": (options.seed, None),
    }
    overridden = []
    for axis, (now, default) in asked.items():
        if axis not in plan:  # a Plan of an earlier version without it
            continue
        stored, reason = plan[axis].get("value"), stored_reason(plan[axis].get("reason", ""))
        if isinstance(stored, bool):
            # asked on then too, and it could not be; a plain "requested" off was asked off
            if now == "on" and not stored and reason.startswith("requested, but"):
                continue
            stored = "on" if stored else "off"
        if axis == "seed" and stored is None:  # the data order's seed was 0, and the RNGs are the checkpoint's
            stored = 0
        if axis == "attention":  # a run moved to another kind of device takes the kernel asked now
            stored = "auto" if stored == "default" else stored
            if not same_kind(str(plan.get("device", {}).get("value", "")), options.devices):
                continue
        stored = "none" if stored is None else stored
        if now != default and now != stored:
            overridden.append(f"--{axis.replace('_', '-')} {now} asked, the checkpoint's {stored} kept")
    return overridden


def find_resume(resume: str | None, root: Path | None, env: DistEnv) -> Checkpoint | None:
    """The checkpoint the run starts from: ``resume``'s ("auto" or a path; None for a new run), all ranks together.

    A worker torchrun restarted (--max-restarts) goes on from the newest checkpoint under ``root``, the
    one its last attempt wrote, even where ``resume`` names a path: that path is where the first
    attempt started. Without one under ``root``, or without ``root`` (no out_dir: a warning says the
    attempt starts over), it starts as the first attempt did.
    """
    if env.restart_count > 0 and root is None and env.is_main:
        log.warning(
            "restarted after a failure (restart %d), with no out_dir: the last attempt wrote no checkpoint, so this "
            "one trains again from %s\nhint: pass --out DIR (out_dir=...) for a restart to go on from the last "
            "checkpoint", env.restart_count, resume or "the start",
        )  # fmt: skip
    if env.restart_count > 0 and root is not None and resume != "auto":
        found = checkpoint.open_checkpoint("auto", root)
        if found is not None or resume is None:
            if found is None and env.is_main:
                log.warning("no checkpoint under %s; starting from scratch", root)
            return found
    if resume is None:
        return None
    found = checkpoint.open_checkpoint(resume, root or Path("."))
    if found is None and env.is_main:  # rank 0 speaks for the job
        log.warning("no checkpoint under %s; starting from scratch", root)
    return found


def warn_unsaved(found: Checkpoint | None, out_dir: Path | None, env: DistEnv, *, replaced: Any = None) -> None:
    """Warn that a run resumed without an out_dir writes nothing: its steps end with the process; and that a fit
    which does not resume replaces the model an earlier fit() or evaluate() of the Trainer left (``replaced``)."""
    if found is None and replaced is not None and env.is_main:  # a notebook's second fit(), meant to train on
        log.warning(
            "fit() trains a fresh model built from the task: trainer.model, from the last fit() or evaluate(), is "
            "replaced, not trained on\nhint: to train on, fit once with more max_steps, or resume its checkpoint "
            "(out_dir=DIR with resume='auto')"
        )
    if found is not None and out_dir is None and env.is_main:
        run_dir = found.path.parent.parent if found.path.parent.name == "checkpoints" else None
        if run_dir is None:
            where = ""
        elif any(c.step > found.step for c in checkpoint.find_checkpoints(found.path.parent)):
            where = f" of its own: {run_dir} goes on past this step, a branch from it needs another"
        else:
            where = f" (--out {run_dir} continues that run there)"
        log.warning(
            "resuming from %s without --out (out_dir): this run writes no checkpoint, weights or summary, so what it "
            "trains is lost when it ends\nhint: pass --out DIR%s", found.path, where
        )  # fmt: skip


def stored_summary(out_dir: Path, env: DistEnv) -> TrainSummary | None:
    """Rank 0's summary.json of a run that had ended, on every rank; None when it cannot be read.

    Without it (a run killed before writing it) the run goes on: its loop has nothing left to do
    and it writes the summary.
    """
    stored = read_summary(out_dir / "summary.json") if env.is_main else None
    stored = gather_objects(stored)[0]  # rank 0's: other machines may not see its out_dir
    try:
        return TrainSummary.from_dict(stored) if stored is not None else None
    except (TypeError, KeyError) as exc:
        log.warning("%s does not hold a run summary (%s); it will be written again", out_dir / "summary.json", exc)
        return None


def ended_run(
    pos: Position,
    stopped: str,
    *,
    total: float,
    max_epochs: float,
    max_steps: int | None,
    out_dir: Path | None,
    env: DistEnv,
    stopping: EarlyStopping | None = None,
    found: Checkpoint | None = None,
) -> tuple[TrainSummary | None, str]:
    """Whether a resumed run (at ``pos``; ``stopped`` as its checkpoint says) has nothing left to train under this
    run's length (``total`` steps, ``max_epochs``, ``max_steps``): its summary, and why it ended ("" if it goes on).

    A run early stopping ended stays ended while this run's ``stopping`` (its state restored) still says stop:
    one given more patience, or none, trains on. A run resumed from another run's checkpoint (``found``, outside
    ``out_dir``) with nothing to train is refused (``_nothing_to_train``), on every rank alike.

    The summary is None where it goes on, or where its summary.json cannot be read (a run killed after its last
    checkpoint): that run starts with its reason to stop, so its loop trains no step and writes its results again.
    """
    if stopped == "early stopping" and (stopping is None or stopping.bad_evals < stopping.patience):
        stopped = ""  # this run's early stopping (or none) lets it train on
    reason = _end_reason(pos, stopped, total=total, max_epochs=max_epochs, max_steps=max_steps)
    if not reason:
        return None, reason
    if found is not None and out_dir is not None and found.path.resolve().parent != (out_dir / "checkpoints").resolve():
        raise _nothing_to_train(found, pos, reason, out_dir=out_dir, max_epochs=max_epochs, max_steps=max_steps)
    ended = stored_summary(out_dir, env) if out_dir is not None else None
    if not env.is_main:  # rank 0 speaks for the job
        return ended, reason
    if ended is None:
        if max_steps is not None and pos.step > max_steps:  # not this run's own end: a count taken as "more steps"
            log.warning(
                "resumed at step %d, past --max-steps %d: nothing to train (--max-steps counts the run's steps from "
                "its start, the resumed ones included)\nhint: to train %d more, pass --max-steps %d",
                pos.step, max_steps, max_steps, pos.step + max_steps,
            )  # fmt: skip
        return None, reason
    if reason == "early stopping":
        further = "to train it further, raise --early-stopping-patience, or drop early stopping"
    elif max_steps is not None and max_steps < pos.step:  # a count taken as "more steps", as above
        further = f"to train {max_steps} more, pass --max-steps {pos.step + max_steps} (it counts from the start)"
    else:
        further = "to train it further, raise --max-steps or --epochs (max_steps or max_epochs in Python)"
    if ended.stopped.startswith("signal"):  # stopped early, and this run asks for no more steps than it has
        log.warning(
            "the run in %s was stopped at step %d (by %s), as far as this run's --max-steps or --epochs goes or "
            "past it: nothing to train; its checkpoints, logs and summary are left as they were\nhint: %s",
            out_dir, pos.step, ended.stopped, further,
        )  # fmt: skip
    else:
        log.warning(
            "the run in %s ended at step %d (stopped: %s): its checkpoints, logs and summary are left as they "
            "were\nhint: %s", out_dir, pos.step, ended.stopped, further
        )  # fmt: skip
    return ended, reason


def _nothing_to_train(
    found: Checkpoint, pos: Position, reason: str, *, out_dir: Path, max_epochs: float, max_steps: int | None
) -> ConfigError:
    """The refusal of a run resumed from ``found`` into an out_dir of its own where it would train no step (it ends
    there for ``reason``): that out_dir would hold its results and logs and no checkpoint, and the next command there,
    the same one with a larger length, would be refused as a run among another's logs."""
    if reason == "early stopping":
        end = "where early stopping ended its run, and this run's early stopping says stop there too"
        more = "to train further, raise --early-stopping-patience (EarlyStopping(patience=...)), or drop early stopping"
    elif reason == "max_steps" and max_steps is not None and max_steps < pos.step:  # a count taken as "more steps"
        end = f"past the end of this run (--max-steps {max_steps} counts from the run's start, the resumed steps too)"
        more = f"to train {max_steps} more, pass --max-steps {pos.step + max_steps} (max_steps={pos.step + max_steps})"
    elif reason == "max_steps":
        end = f"the end of this run (--max-steps {max_steps})"
        more = f"to train further, pass --max-steps (max_steps=) larger than {max_steps}"
    else:
        end = f"the end of this run (the last step of --epochs {max_epochs:g})"
        more = f"to train further, pass --epochs (max_epochs=) larger than {max_epochs:g}"
    return ConfigError(
        f"nothing to train: {found.path} is at step {pos.step}, {end}; resumed from it into "
        f"out_dir={str(out_dir)!r}, this run would write its results there and no checkpoint to go on from; nothing "
        f"was written\nhint: {more}"
    )


def _end_reason(pos: Position, stopped: str, *, total: float, max_epochs: float, max_steps: int | None) -> str:
    """Why the resumed run (at ``pos``, ``stopped`` as its checkpoint says) had ended, or "": early stopping said
    so, or it reached this run's ``total`` steps (max_steps or epochs: a run ending on an epoch's last step stops
    before its epoch count moves on) or ``max_epochs``; named as the loop names them."""
    if stopped == "early stopping":
        return stopped
    if max_steps is not None and pos.step >= max_steps:
        return "max_steps"
    return "epochs" if pos.step >= total or pos.epoch >= max_epochs else ""


def run_loggers(
    config: TrainerConfig,
    out_dir: Path | None,
    resumed: Position | None,
    batches_per_epoch: int | None,
    *,
    validates: bool,
    evaluates_again: bool,
    stopped: str,
    grad_accum: int,
) -> Loggers:
    """The run's logs in ``out_dir`` (None: none, as on a rank other than 0), each cut back to the resumed position
    (``log_cut``, with its arguments); ``validates``: the task has validation data."""
    if out_dir is None:
        return open_loggers((), Path("."))
    each_epoch, every = validates and not config.eval_every, config.eval_every
    step, evals = log_cut(
        resumed, batches_per_epoch, evaluates_each_epoch=each_epoch, evaluates_again=evaluates_again,
        grad_accum=grad_accum, stopped=stopped, eval_every=every,
    )  # fmt: skip
    return open_loggers(config.loggers, out_dir, resume_step=step, eval_resume_step=evals)


def load_run(
    rt: Runtime,
    found: Checkpoint,
    task: str,
    scheduler: Schedule,
    *,
    stopping: EarlyStopping | None,
    best: BestWeights | None,
) -> dict[str, Any]:
    """Load checkpoint ``found`` into ``rt`` (model, optimizer, Plan) and into what evaluations move (``scheduler``,
    early ``stopping``, ``best``); return its extra state, where the run's position is. A checkpoint of another
    model written by another ``task`` (this run's name) says so."""
    written_by = check_written_by_trainer(found)  # before the load: its model or optimizer may differ too
    try:
        state = rt.load(found)
    except ModelMismatch as exc:
        if written_by and written_by != task:  # the checkpoint of another task's run: the names say why
            said, _, _ = str(exc).partition("\nhint: ")
            raise ModelMismatch(
                f"{said}; it was written by task {written_by!r}, and this run trains task {task!r}\nhint: resume "
                f"with the task the run began with ({written_by!r}); to train this one, start a new run (another --out)"
            ) from exc
        raise
    check_written_by_trainer(found, state)
    scheduler.load_state_dict(state.get("scheduler"), steps=found.step, source=str(found.path), warn=rt.env.is_main)
    if stopping is not None and state.get("early_stopping"):
        stopping.load_state_dict(state["early_stopping"])
    if best is not None:
        best.load_state_dict(state.get("best"))
    rt.resumed_from(checkpoint.load_plan(found), found.step)
    return state


def owes_evaluation(state: Mapping[str, Any], step: int, eval_every: int | None, val_data: object) -> bool:
    """Whether a run resumed at ``step`` (its checkpoint's ``state``) owes that step's evaluation: due every
    ``eval_every`` steps, it failed (the error kept the steps without it), or it was the run's last step, kept before
    its evaluation. An older checkpoint says nothing: none."""
    if not eval_every or val_data is None:
        return False
    return state.get("evaluated") is False and step % eval_every == 0


def log_cut(
    pos: Position | None,
    batches_per_epoch: int | None,
    *,
    evaluates_each_epoch: bool,
    evaluates_again: bool = False,
    grad_accum: int = 1,
    stopped: str = "",
    eval_every: int | None = None,
) -> tuple[int | None, int | None]:
    """The steps a resumed run (at ``pos``; None for a new run) cuts its training and evaluation logs back to.

    An epoch's last step is checkpointed before the epoch's evaluation, and a run's last step before its
    final one; resumed from there, the run evaluates that step again (``evaluates_again``: with nothing left
    to train, or owing that evaluation, as ``owes_evaluation`` says), so the earlier run's row of it goes. With
    ``grad_accum`` micro-batches a step, an epoch whose last batches make no whole step evaluates at the step
    before them: a checkpoint there is at its end too. A run that had stopped (``stopped``: a signal, or
    --max-steps it is now resumed past) evaluated its last step where none was due (every ``eval_every`` steps,
    or at an epoch's end): an unbroken run has no such row, so it goes.
    """
    if pos is None:
        return None, None
    at_end = batches_per_epoch is not None and batches_per_epoch - pos.batches_in_epoch < grad_accum
    if evaluates_each_epoch:
        due = at_end or (pos.batches_in_epoch == 0 and pos.step > 0)  # 0: checkpointed after the epoch's evaluation
    else:
        due = bool(eval_every) and pos.step % (eval_every or 1) == 0
    again = evaluates_again or (evaluates_each_epoch and at_end) or (bool(stopped) and not due)
    return pos.step, pos.step - 1 if again and pos.step else pos.step


def _available_device(options: RuntimeOptions) -> RuntimeOptions:
    """Keep a checkpoint's device where this machine has it (the device resolver decides), else use "auto"."""
    try:
        resolve_device(options.devices, probe_accelerators())
    except DeviceUnavailableError:
        return dataclasses.replace(options, devices="auto")
    return options


def check_written_by_trainer(found: Checkpoint, state: dict[str, Any] | None = None) -> str:
    """Refuse a checkpoint a loop of the user's own wrote (its extra state holds no Trainer position); return the
    name of the task that wrote it ("" where not saved).

    Without ``state`` (before the load) it reads the checkpoint's extra.pt, where both formats keep it;
    a layout that keeps it elsewhere (redline 0.1's) is told by the loaded ``state`` instead.
    """
    extra = found.path / "extra.pt"
    if state is None and not extra.is_file():
        return ""
    held = state if state is not None else load_safely(extra, "cpu")
    if "position" in held:
        data = held.get("data")
        return str(data.get("task") or "") if isinstance(data, dict) else ""
    raise CheckpointError(
        f"{found.path} holds no Trainer state: it was not written by the Trainer (Runtime.save in a loop of "
        "your own writes one)\nhint: load it with Runtime.load in that loop, or resume from a checkpoint "
        "`redline train` wrote"
    )
