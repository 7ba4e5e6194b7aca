"""What a training step's failure becomes: an error that says what happened to the run, and what to do."""

from __future__ import annotations

from pathlib import Path

from redline.errors import OutOfMemory, RedlineError, TrainingError, describe_error
from redline.parallel.collectives import is_collective_failure
from redline.runtime.oom import is_oom


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
            f"step {step}: a collective with the other ranks failed: {str(exc).splitlines()[0]}\n"
            "hint: another rank stopped first; its log says why (with --max-restarts K the job restarts from "
            "the last checkpoint)"
        )
    return None
