"""What a training step's failure becomes: an error that says what happened to the run, and what to do."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from redline.errors import ONE_STEP, PEER_STOPPED, OutOfMemory, RedlineError, TrainingError, describe_error, first_line
from redline.parallel.collectives import failed_collective, is_collective_failure
from redline.plan.micro_batch import MicroBatch
from redline.runtime.oom import is_oom

if TYPE_CHECKING:
    from redline.checkpoint import Checkpoint
    from redline.train.state import Run

log = logging.getLogger("redline")


class EvaluationOutOfMemory(OutOfMemory):
    """The device ran out of memory while evaluating: micro-batches, which split a training step, do not help."""


def step_failure(
    exc: BaseException, step: int, snapshot: Path | None = None, *, in_optimizer: bool = False
) -> TrainingError | None:
    """Return the TrainingError that ``exc`` from step ``step`` becomes, or None for one that passes as it is.

    An out-of-memory the Runtime did not recover from names the memory snapshot (CUDA) and the way
    out: for the forward and backward of a whole batch, ``--micro-batch``; for the optimizer's step,
    which no split of the batch makes smaller (``in_optimizer``: it failed there), less state or state
    sharded. A failed collective says another rank stopped first.
    """
    if isinstance(exc, RedlineError):
        return None
    if is_oom(exc):
        written = f"; memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)" if snapshot else ""
        hint = OPTIMIZER_STEP_HINT if in_optimizer else SPLIT_HINT + LOWER_BATCH
        return OutOfMemory(f"step {step}: the device ran out of memory: {describe_error(exc)}{written}\nhint: {hint}")
    if is_collective_failure(exc):  # a dead peer surfaces in this rank's next collective, wherever it is
        return peer_failure(exc, f"step {step}")
    return None


def peer_failure(exc: BaseException, where: str) -> TrainingError:
    """The TrainingError a collective that broke (``exc``) at ``where`` becomes: another rank stopped first."""
    return TrainingError(
        f"{where}: a collective with the other ranks failed: {failed_collective(exc)}\nhint: {PEER_STOPPED}"
    )


SPLIT_HINT = (
    "--micro-batch auto (micro_batch='auto') splits the batch in halves on out-of-memory and redoes it by gradient "
    "accumulation, losing no step"
)
LOWER_BATCH = "; or lower --batch-size"  # not once steps are kept: a resumed run keeps its batch size
OPTIMIZER_STEP_HINT = (
    "it ran out in the optimizer's step, where neither micro-batches nor a smaller batch help: the gradients and "
    "the optimizer's state (AdamW's is two copies of the weights, allocated at the first step) are as large at any "
    "batch. FSDP shards them over N GPUs (`redline launch --nproc N` with --strategy fsdp); an optimizer that keeps "
    "less state needs less (SGD with momentum keeps one copy of the weights, torch.optim.Adafactor a factored "
    "one); `redline memory --task SPEC` weighs each part against the GPU"
)


def check_finite(losses: list[float], first_step: int, last: Checkpoint | None, *, precision: str) -> None:
    """Raise TrainingError at the first of ``losses`` (of the steps from ``first_step`` on) that is not finite.

    A NaN spreads to every weight in the next step: the run stops there, naming ``last``, the newest
    checkpoint (none holds a NaN: the losses are read before each one is written). ``precision`` is the run's,
    which decides whether bf16-mixed is worth a try.
    """
    for offset, value in enumerate(losses):
        if not math.isfinite(value):
            where = f"the last good checkpoint is {last.path}" if last else "no checkpoint was written yet"
            step = first_step + offset
            raise TrainingError(
                f"step {step}: the loss is {value}; training stopped ({where})\nhint: {nan_hint(step, precision)}"
            )


def nan_hint(step: int, precision: str) -> str:
    """What to try for a loss that is not finite at ``step``. At the first no optimizer step has run: the weights
    are as the model made them, so the batch or the loss made it, and a lower learning rate would not help."""
    if step == 1:
        hint = (
            "no optimizer step ran before it, so the learning rate is not the cause: look for NaN or inf in the "
            "first batch's inputs or targets, and at task.loss_fn (a log or a division of 0) and the model's "
            f"initial weights; `{ONE_STEP}` runs this step alone"
        )
    else:
        hint = "lower the learning rate, or clip gradients (--clip-grad-norm 1.0)"
    if precision == "fp16-mixed":
        return hint + "; or use bf16-mixed instead of fp16-mixed (fp16 overflows above 65504; bf16 has fp32's range)"
    return hint


RESUME_AGAIN = "then run the same command with --resume auto (in Python: resume='auto')"


def kept_note(saved: str, resume: str = RESUME_AGAIN) -> str:
    """What a failure's message adds when the steps before it are saved in ``saved``; ``resume`` says how on (a
    failure is said in the command line's words, as refusals are, and the Python argument beside them)."""
    return f"; the steps so far are saved in {saved}: {resume}"


def oom_kept_note(saved: str, micro_batch: MicroBatch) -> str:
    """``kept_note`` for an out-of-memory: the same command would run out again where the last run did, and a
    resumed run keeps its batch size and precision (the data position counts batches), so ``micro_batch`` "auto"
    is what a resume can add."""
    if micro_batch == "auto":
        return kept_note(saved, RESUMED_AUTO)
    return kept_note(saved, "then run the same command with --resume auto --micro-batch auto " + RESUMED_SPLIT)


RESUMED_SPLIT = "(a resumed run keeps its batch size: its micro-batches are what can shrink)"
RESUMED_AUTO = (
    "a resumed run (--resume auto) keeps their batch size and precision, so the same command would run out of memory "
    "again"
)


@contextlib.contextmanager
def keeping_steps(run: Run, keep: Callable[[], str | None], *, distributed: bool) -> Iterator[None]:
    """A one-process run that trained and fails inside first checkpoints the steps since its last checkpoint
    (``keep_steps``). In a ``distributed`` run the other ranks wait inside a collective that a checkpoint would
    wait on too. A collective that breaks between steps says another rank stopped first, as one inside a step does
    (``step_failure``), not in the transport's words."""
    try:
        yield
    except Exception as exc:
        if not distributed:
            keep_steps(exc, run, keep)
        if is_collective_failure(exc):  # outside a step (a log window's read, a checkpoint, the final weights)
            raise peer_failure(exc, f"after step {run.pos.step}") from exc
        raise


def keep_steps(exc: Exception, run: Run, keep: Callable[[], str | None]) -> None:
    """Checkpoint the steps a failing run trained since its last checkpoint (``keep`` writes it), and say where.

    A failure inside a step (reading its batches, their forwards and backwards) puts the run back to the step's start
    (its position, random streams and running statistics): the resumed run redoes it whole, as the unbroken run did.
    A failure inside the optimizer's step keeps nothing: the weights may be half updated.
    A redline error's message names the checkpoint; any other exception passes unchanged, after a warning.
    """
    if run.in_optimizer_step:
        return
    if run.step_under_way:
        run.back_to_step_start()  # the step is redone whole on resume: its batches so far are not the checkpoint's
    else:
        run.put_back_evaluation()  # an epoch's evaluation failed: the resumed run does it again
    try:
        saved = keep()
    except Exception as again:  # the disk is full, say; a NaN loss fails again (no checkpoint holds one)
        if str(again) != str(exc):
            log.warning("the steps since the last checkpoint could not be saved: %s", first_line(again))
        return
    # Written now, or already at this step (a failure just after a checkpoint): either holds every step so far.
    if saved is None or run.last_ckpt is None or run.last_ckpt.step != run.pos.step:
        return
    if isinstance(exc, OutOfMemory) and not isinstance(exc, EvaluationOutOfMemory):  # a step's: micro-batches help
        exc.args = (f"{str(exc).replace(LOWER_BATCH, '')}{oom_kept_note(saved, run.rt.options.micro_batch)}",)
    elif isinstance(exc, RedlineError):
        exc.args = (f"{exc}{kept_note(saved)}",)
    else:
        log.warning("%s", kept_note(saved).removeprefix("; "))
