"""Reading a committed checkpoint's files back: its Plan (``load_plan``), and a file that verifies against its
manifest and yet cannot be parsed (``parsing``), named with the checkpoint before it."""

from __future__ import annotations

import contextlib
import json
import pickle
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
    Anything else (an out-of-memory, a device's error, the file system's OSError, ``passing``) passes as it is."""
    try:
        yield
    except (RedlineError, OSError, passing):
        raise
    except Exception as exc:
        if not _unparsable(exc):  # out of memory, a device's error: nothing the file's bytes did
            raise
        raise unparsed(path, exc) from exc


ZIP_READER = ("PytorchStreamReader", "zip archive", "inline_container")  # torch.load's words for a torn zip file


def _unparsable(exc: Exception) -> bool:
    """Whether ``exc`` is a reader's refusal of a file's bytes: safetensors' header, torch's zip reader, JSON or text
    that does not decode, a pickle cut short."""
    if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError | EOFError | pickle.UnpicklingError):
        return True
    if type(exc).__name__ == "SafetensorError":
        return True
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in ZIP_READER)


def unparsed(path: Path, exc: BaseException) -> CheckpointError:
    """The error of checkpoint file ``path`` that verified (its size and checksum are the manifest's) and yet cannot
    be parsed: written so by a fault, or its manifest rewritten since."""
    earlier = earlier_than(path.parent)
    if earlier is not None:
        fix = (
            f"move {path.parent} out of {path.parent.parent} (to look at it later) and resume from the checkpoint "
            f"before it, {earlier.path}: where this one was the newest, --resume auto (resume='auto') then takes "
            "that one; in a loop of your own, rt.load it"
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
