"""What a training step's failure becomes: an error that says what happened to the run, and what to do."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from redline.errors import OutOfMemory, RedlineError, TrainingError, describe_error, first_line
from redline.parallel.collectives import failed_collective, is_collective_failure
from redline.runtime.oom import is_oom

if TYPE_CHECKING:
    from redline.checkpoint import Checkpoint
    from redline.train.state import Run

log = logging.getLogger("redline")


def step_failure(exc: BaseException, step: int, snapshot: Path | None = None) -> TrainingError | None:
    """Return the TrainingError that ``exc`` from step ``step`` becomes, or None for one that passes as it is.

    An out-of-memory the Runtime did not recover from (no ``--micro-batch``) names the recovery and
    the memory snapshot (CUDA); a failed collective says another rank stopped first.
    """
    if isinstance(exc, RedlineError):
        return None
    if is_oom(exc):
        written = f"; memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)" if snapshot else ""
        return OutOfMemory(
            f"step {step}: the device ran out of memory: {describe_error(exc)}{written}\n"
            "hint: --micro-batch auto (micro_batch='auto') splits the batch in halves on out-of-memory and redoes it "
            "by gradient accumulation, losing no step; or lower --batch-size"
        )
    if is_collective_failure(exc):  # a dead peer surfaces in this rank's next collective, wherever it is
        return TrainingError(
            f"step {step}: a collective with the other ranks failed: {failed_collective(exc)}\n"
            "hint: another rank stopped first; its log says why (with --max-restarts K the job restarts from "
            "the last checkpoint)"
        )
    return None


def check_finite(losses: list[float], first_step: int, last: Checkpoint | None) -> None:
    """Raise TrainingError at the first of ``losses`` (of the steps from ``first_step`` on) that is not finite.

    A NaN spreads to every weight in the next step: the run stops there, naming ``last``, the newest
    checkpoint (none holds a NaN: the losses are read before each one is written).
    """
    for offset, value in enumerate(losses):
        if not math.isfinite(value):
            where = f"the last good checkpoint is {last.path}" if last else "no checkpoint was written yet"
            raise TrainingError(
                f"step {first_step + offset}: the loss is {value}; training stopped ({where})\n"
                "hint: lower the learning rate, clip gradients (--clip-grad-norm 1.0), or use bf16-mixed "
                "instead of fp16-mixed"
            )


def kept_note(saved: str) -> str:
    """What a failure's message adds when the steps before it are saved in ``saved``."""
    return f"; the steps so far are saved in {saved}: then run the same command with --resume auto"


def keep_steps(exc: Exception, run: Run, keep: Callable[[], str | None]) -> None:
    """Checkpoint the steps a failing run trained since its last checkpoint (``keep`` writes it), and say where.

    A failure among a step's micro-batches puts the position back to the step's start: the resumed run
    redoes them all. A failure inside the optimizer's step keeps nothing: the weights may be half updated.
    A redline error's message names the checkpoint; any other exception passes unchanged, after a warning.
    """
    if run.in_optimizer_step:
        return
    if run.micro_loss is not None and run.step_start is not None:
        run.pos = run.step_start
    try:
        saved = keep()
    except Exception as again:  # the disk is full, say; a NaN loss fails again (no checkpoint holds one)
        if str(again) != str(exc):
            log.warning("the steps since the last checkpoint could not be saved: %s", first_line(again))
        return
    # Written now, or already at this step (a failure just after a checkpoint): either holds every step so far.
    if saved is None or run.last_ckpt is None or run.last_ckpt.step != run.pos.step:
        return
    if isinstance(exc, RedlineError):
        exc.args = (f"{exc}{kept_note(saved)}",)
    else:
        log.warning("%s", kept_note(saved).removeprefix("; "))
