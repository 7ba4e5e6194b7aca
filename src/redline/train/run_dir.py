"""The checkpoints folder a run writes to: refused where it would mix this run's checkpoints with another run's
(``prepare_checkpoint_dir`` in the workers, ``refuse_before_launch`` in the launcher), and cleared of what a killed
write left."""

from __future__ import annotations

from pathlib import Path

from redline import checkpoint
from redline.checkpoint import Checkpoint, CheckpointError
from redline.checkpoint.loadable import load_safely
from redline.errors import ConfigError, invalid
from redline.parallel.collectives import run_on_rank0
from redline.parallel.env import DistEnv
from redline.train.logs import LOG_FILES, logs_with_rows, stopped_on_nonfinite


def prepare_checkpoint_dir(root: Path, env: DistEnv, *, resume: str | None, found: Checkpoint | None) -> None:
    """Refuse a run that would mix its checkpoints with another's, and remove what a killed checkpoint write left.

    A new run (no ``resume``, not a restarted worker) among an earlier run's checkpoints would prune
    by step number, deleting its own when the earlier run had gone further, and a later
    ``resume="auto"`` would continue the earlier run. So would a run resumed from a path (``found``)
    where ``root`` holds checkpoints of another run, or of its own run past ``found``'s step. A new run where no
    checkpoint is but logs with rows are (a run killed before its first checkpoint) would replace those logs.
    Collective: rank 0 lists, every rank refuses alike.
    """
    explicit = resume not in (None, "auto") and found is not None
    if env.restart_count == 0 and (resume is None or explicit):
        steps, others, logs = run_on_rank0(lambda: _listed(root), "listing the checkpoints")
        _refuse(root, found, steps, others, logs)
    if env.is_main:
        checkpoint.clean_staging(root)


def refuse_before_launch(root: Path | None, resume: str | None) -> None:
    """Refuse, in the launcher of `train --nproc` before any worker starts, what ``prepare_checkpoint_dir`` refuses
    in the workers' first attempt: a worker torchrun restarts (--max-restarts) goes on from the newest checkpoint
    under ``root``, so a refusal of the first attempt alone would be undone, and the job would continue another run.
    A ``resume`` path with nothing there is refused too (without --out, ``root`` None), once rather than per attempt."""
    if resume == "auto":
        return
    found = None
    if resume is not None:
        try:
            found = checkpoint.read_checkpoint(Path(resume))  # its manifest: the workers verify it
        except (checkpoint.CheckpointError, OSError):
            if not Path(resume).exists():  # rank 0, started on this machine, would find nothing there either
                raise
            return  # the workers say what is wrong with it
    if root is not None:
        _refuse(root, found, *_listed(root))


def _refuse(root: Path, found: Checkpoint | None, steps: list[int], others: list[int], logs: list[str]) -> None:
    # a run killed before its first checkpoint, or one whose were deleted; not one stopped on a NaN, rerun as told
    if not steps and found is None and logs and not stopped_on_nonfinite(root.parent):
        raise invalid(
            "out_dir", str(root.parent),
            f"a directory of its own: it holds an earlier run's logs ({', '.join(logs)}) and no checkpoint (that run "
            "stopped before its first, or its checkpoints were deleted), which a new run there would replace",
            "pass another out_dir=DIR; to start over there, pass resume='auto' (it finds no checkpoint and replaces "
            "those logs) or delete them (nothing was written: they are as they were)",
        )  # fmt: skip
    if not steps and found is not None and found.path.resolve().parent != root.resolve():
        logs = [name for names in LOG_FILES.values() for name in names if (root.parent / name).exists()]
        if logs:  # a run killed before its first checkpoint: the resumed run's steps would follow that run's
            raise ConfigError(
                f"out_dir={str(root.parent)!r} holds another run's logs ({', '.join(logs)}) and no checkpoint; "
                f"resumed from {found.path} there, this run's steps would be logged after that run's, as one run\n"
                f"hint: pass another --out for it, or move those logs out of {root.parent}"
            )
    if steps and found is None:
        raise _earlier_run(root, steps[-1], logs, other_version=steps[-1] in others)
    if steps and found is not None:
        _refuse_a_mix(root, found, steps, others)


def _earlier_run(root: Path, newest: int, logs: list[str], *, other_version: bool) -> ConfigError:
    """The error of a new run in an out_dir whose checkpoints under ``root`` go up to step ``newest``; where
    ``other_version`` wrote that one, --resume auto stops there: only the version that wrote it goes on. A run that
    ended there (its checkpoint's ``stopped``) is said to be finished: --resume auto alone would train no step, and
    writes the results where that run's are missing (a second Ctrl-C after its last step skipped them)."""
    written = ", written by another version of redline" if other_version else ""
    ended = "" if other_version else _ended_at(checkpoint.step_dir(root, newest))
    if ended:
        further = "a larger max_steps=N or max_epochs=N"
        if ended == "early stopping":
            further = "more early stopping patience (or none)"
        held = f"a finished run's checkpoints (the newest at step {newest}, where it ended; stopped: {ended})"
        hint = f"to train that run further, pass resume='auto' with {further}; for a new run, pass another out_dir=DIR"
        if not (root.parent / "summary.json").is_file():  # a second Ctrl-C after its last step, or a kill
            held += " but not its results (no summary.json: they were skipped or cut short)"
            hint = f"to write them, pass resume='auto' with that run's settings (it trains no step); {hint}"
    else:
        held = f"an earlier run's checkpoints (the newest at step {newest}{written})"
        go_on = "the version of redline that wrote it" if other_version else "resume='auto'"
        hint = f"continue that run with {go_on}, or pass another out_dir=DIR"
    return invalid(
        "out_dir", str(root.parent),
        f"a directory of its own: it holds {held}, and a new run there would mix its checkpoints and logs with "
        "that run's", f"{hint}; to start over, delete {root}{_logs_too(logs)}",
    )  # fmt: skip


def _logs_too(logs: list[str]) -> str:
    """What else a new run needs deleted, once the checkpoints are: ``logs``, those with rows beside them."""
    return f" and the logs beside it ({', '.join(logs)})" if logs else ""


def _ended_at(found: Path) -> str:
    """Why the run whose checkpoint is ``found`` ended there (its ``stopped``: max_steps, epochs, early stopping), or
    "" where it went on, a signal stopped it, or its state cannot be read."""
    try:
        stopped = load_safely(found / "extra.pt", "cpu").get("stopped") or ""
    except (CheckpointError, OSError, RuntimeError, EOFError):  # a layout without extra.pt, or a damaged one
        return ""
    return "" if not isinstance(stopped, str) or stopped.startswith("signal") else stopped


def _listed(root: Path) -> tuple[list[int], list[int], list[str]]:
    """``_repaired_steps``, and the logs beside ``root`` that hold rows (``logs_with_rows``)."""
    return (*_repaired_steps(root), logs_with_rows(root.parent))


def _repaired_steps(root: Path) -> tuple[list[int], list[int]]:
    """The steps of the checkpoints under ``root`` (another version of redline's among them), after putting back one
    a crash left moved aside; and the steps of those another version wrote, which this one keeps but never reads."""
    checkpoint.recover(root)
    others = checkpoint.other_versions(root)
    return sorted([c.step for c in checkpoint.find_checkpoints(root)] + others), others


def _refuse_a_mix(root: Path, found: Checkpoint, steps: list[int], others: list[int]) -> None:
    """Refuse to resume from ``found`` into ``root``, whose checkpoints are at ``steps`` (``others`` of another
    version of redline), where they belong to another run or go past ``found``: the resumed run's own checkpoints
    would be pruned first, and --resume auto would continue the others (or stop at another version's)."""
    if found.path.resolve().parent != root.resolve():
        what = "checkpoints of its own (of another run, or of this one resumed there before)"
        hint = (
            f"to continue the run there, pass --resume auto; to resume from {found.path} anew, pass another --out "
            f"(or delete {root})"
        )
    elif steps[-1] > found.step:
        past = [step for step in steps if step > found.step]
        newer = [f"{step} (another version of redline)" if step in others else str(step) for step in past]
        what = f"checkpoints past step {found.step} (at {', '.join(newer)})"
        hint = (
            f"to branch from step {found.step}, pass another --out (the checkpoint is read where it is); to take "
            f"this run back to it, delete the checkpoints past it under {root}"
        )
    else:
        return
    raise ConfigError(
        f"out_dir={str(root.parent)!r} holds {what}; resumed from {found.path} there, this run's checkpoints would be "
        f"pruned before them, and --resume auto would continue those, not this run\nhint: {hint}"
    )
