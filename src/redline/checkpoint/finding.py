"""Finding the checkpoint a run resumes from: the newest one that verifies, or a path, agreed by all ranks."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from pathlib import Path

from redline.checkpoint.layout import (
    MANIFEST,
    Checkpoint,
    CheckpointError,
    FormatError,
    find_checkpoints,
    read_checkpoint,
    recover,
    run_dirs,
    step_of,
    verify,
)
from redline.checkpoint.reading import earlier_than
from redline.parallel.collectives import gather_objects, rank_and_world, run_on_rank0

log = logging.getLogger("redline")


def open_checkpoint(where: str | Path, root: Path) -> Checkpoint | None:
    """Return the checkpoint to resume from: ``"auto"`` picks the newest under ``root`` that verifies, else a path.

    Collective under several processes: rank 0 lists the checkpoints, so every rank considers the
    same ones in the same order, and the ranks verify each together, so they agree on the one they
    resume from. A checkpoint met on the way that does not verify, or whose manifest cannot be read,
    is logged and skipped for an older one; an explicit path that does not verify is an error. None
    where ``root`` holds no checkpoint; where it holds some and none verifies, a CheckpointError that
    names each: a new run among them would overwrite and prune them, and the run would be lost.
    """
    if str(where) != "auto":
        try:
            return open_verified(Path(where))
        except CheckpointError as exc:
            near, which = _checkpoint_near(Path(where))
            if near is None and (earlier := earlier_than(Path(where))) is not None:  # it is corrupt
                raise CheckpointError(
                    f"{str(exc).split(chr(10))[0]}\nhint: the checkpoint is corrupt; resume from an earlier one beside "
                    f"it, --resume {earlier.path}, or with --resume auto --out {earlier.path.parent.parent} (which "
                    "skips it)"
                ) from None
            if near is None:
                raise
            lead = f"pass the checkpoint directory itself, e.g. --resume {near.path} ({which})"
            if not which:  # an uncommitted directory beside committed checkpoints
                lead = f"resume from the newest committed checkpoint beside it, --resume {near.path}"
            raise CheckpointError(
                f"{str(exc).split(chr(10))[0]}\nhint: {lead}, or --resume auto with --out {near.path.parent.parent}"
            ) from None
    listed = run_on_rank0(lambda: [str(path) for path in _step_dirs(root, repaired=True)], "listing the checkpoints")
    problems, skipped = [], []
    for path in reversed(listed):
        try:
            found = open_verified(Path(path))
        except FormatError as exc:  # a newer redline's, not corrupt: skipped, it would be trained past and written over
            raise FormatError(
                f"{str(exc).split(chr(10))[0]}\nhint: resume with the version of redline that wrote it; --resume auto "
                "does not go back past it to an older checkpoint, whose run would write over it (to go on from an "
                "older one, pass it as --resume PATH with another --out)"
            ) from None
        except CheckpointError as exc:
            problems.append(str(exc).split("\nhint:")[0])
            with contextlib.suppress(CheckpointError):  # its manifest reads: a checkpoint pruning would count
                skipped.append(read_checkpoint(Path(path)))
            continue
        for problem in problems if rank_and_world()[0] == 0 else ():  # every rank found them: rank 0 says so
            log.warning("skipping a corrupt checkpoint: %s", problem)
        return replace(found, skipped=tuple(skipped))
    if problems:
        raise CheckpointError(
            f"{root}: no checkpoint there verifies ({len(problems)} tried), so the run cannot resume:\n  "
            + "\n  ".join(problems)
            + f"\nhint: a new run there would write over them; to start over, delete {root} or pass another "
            "--out (out_dir=...); to resume from a copy kept elsewhere, pass --resume PATH"
        )
    return None


def _checkpoint_near(path: Path) -> tuple[Checkpoint | None, str]:
    """The checkpoint a resume path that is none meant, and which it is: the one a file is in, the newest in a
    run or checkpoints directory, or the newest of the run a file such as model.safetensors is in; for a
    directory never committed (a write a crash cut short), the newest committed beside it, which ``""``; None
    where there is none (a corrupt checkpoint, a path that does not exist)."""
    if path.is_file() and (path.parent / MANIFEST).is_file():
        with contextlib.suppress(CheckpointError):
            return read_checkpoint(path.parent), "the one that file is in"
    for root in (path, path / "checkpoints"):
        found = find_checkpoints(root)
        if found:
            return found[-1], "the newest there"
    found = find_checkpoints(path.parent / "checkpoints") if path.is_file() else []  # OUT/model.safetensors, say
    if found:
        return found[-1], f"the newest of the run {path.name} is in; {path.name} alone holds no optimizer or position"
    if path.is_dir() and not (path / MANIFEST).is_file():  # a write a crash cut short, or a step never committed
        found = [c for c in find_checkpoints(path.parent) if c.path != path]
        if found:
            return found[-1], ""
    return None, ""


def _step_dirs(root: Path, *, repaired: bool = False) -> list[Path]:
    """Return the checkpoint directories under ``root``, readable or not, oldest step (by name) first; ``repaired``:
    after putting back one a crash left moved aside (``recover``)."""
    if repaired:
        recover(root)
    return sorted(run_dirs(root), key=lambda path: (step_of(path, {}), path))


def open_verified(path: Path) -> Checkpoint:
    """Read ``path``'s manifest on every rank and verify it together; every rank raises alike if one fails."""
    try:
        checkpoint, failure = read_checkpoint(path), None
    except CheckpointError as exc:  # this rank cannot read it: the others must hear it, or they would wait
        checkpoint, failure = None, exc
    failures = [f for share in gather_objects([str(failure).split("\n")[0]] if failure else []) for f in share]
    if failure is not None:
        raise failure
    if failures or checkpoint is None:
        raise CheckpointError(
            f"{failures[0]} (seen by another rank)\nhint: the checkpoint directory must be on storage every rank shares"
        )
    verify(checkpoint)
    return checkpoint
