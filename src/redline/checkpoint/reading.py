"""Reading a committed checkpoint's files back: its Plan (``load_plan``), and a file that verifies against its
manifest and yet cannot be parsed (``parsing``), named with the checkpoint before it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from redline.checkpoint.layout import PLAN, Checkpoint, CheckpointError, find_checkpoints, read_checkpoint
from redline.errors import RedlineError, describe_error


def load_plan(checkpoint: Checkpoint) -> dict[str, Any]:
    """Return the Plan the checkpoint was written under, as ``{axis: {"value", "reason"}}``."""
    path = checkpoint.path / PLAN
    if not path.is_file():
        raise CheckpointError(
            f"{checkpoint.path} has no {PLAN}: it was not written by the Runtime or the Trainer\n"
            "hint: resume from a checkpoint that `redline train` or Runtime.save wrote"
        )
    with parsing(path):
        return dict(json.loads(path.read_text(encoding="utf-8")))


@contextlib.contextmanager
def parsing(path: Path, passing: type[Exception] = RedlineError) -> Iterator[None]:
    """Reading ``path``, a file of a committed checkpoint: what its reader raises on contents it cannot parse
    (safetensors' or torch's zip reader, JSON) is a CheckpointError naming the file and the checkpoint before it.
    A redline error, an out-of-memory, a failure of the file system (an OSError) and ``passing`` pass as they are."""
    try:
        yield
    except (RedlineError, OSError, passing):
        raise
    except Exception as exc:
        if type(exc).__name__ == "OutOfMemoryError":  # torch's, loading onto a full GPU: no damage of the file's
            raise
        raise unparsed(path, exc) from exc


def unparsed(path: Path, exc: BaseException) -> CheckpointError:
    """The error of checkpoint file ``path`` that verified (its size and checksum are the manifest's) and yet cannot
    be parsed: written so by a fault, or its manifest rewritten since."""
    earlier = earlier_than(path.parent)
    if earlier is not None:
        fix = (
            f"move {path.parent} out of {path.parent.parent} (to look at it later): a resume (--resume auto; in "
            f"Python, resume='auto') then continues from the checkpoint before it, {earlier.path}"
        )
    else:
        fix = "no earlier checkpoint of the run is beside it: start the run again (another --out)"
    return CheckpointError(
        f"{path} cannot be read ({describe_error(exc)}), though its size and checksum are those its manifest "
        f"records: it was written damaged, or the manifest was rewritten since\nhint: {fix}"
    )


def earlier_than(path: Path) -> Checkpoint | None:
    """The newest checkpoint beside the committed one at ``path`` that is older than it; None where there is none
    (or ``path``'s manifest cannot be read)."""
    with contextlib.suppress(CheckpointError, OSError):
        step = read_checkpoint(path).step
        earlier = [c for c in find_checkpoints(path.parent) if c.step < step]
        return earlier[-1] if earlier else None
    return None
