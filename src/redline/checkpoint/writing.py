"""Writing a checkpoint's files so that a write the system refuses is an OSError, whichever library serialises it.

Neither serialiser says so itself: torch.save's zip writer turns a full disk into a RuntimeError
("[enforce fail at inline_container.cc:...] unexpected pos 17920 vs 17808"), and safetensors into a
SafetensorError ("I/O error: No space left on device (os error 28)"). Raised as the OSError each was,
a full disk, a quota or storage gone read-only reads as such (``layout.write_failure``), and the part
of the checkpoint staged is removed rather than left to fill the disk further.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from redline.atomic import is_stream

# safetensors' message of an I/O failure: "(os error 28)" (>= 0.5), "IoError(Os { code: 28, ..." (0.4)
_OS_ERROR = re.compile(r"(?:os error|code:) (\d+)")


def save_object(value: Any, path: Path) -> None:
    """``torch.save(value, path)``; a write the system refuses raises its OSError, not torch's RuntimeError."""
    with open(path, "wb") as handle:
        stream = _Recording(handle)
        try:
            torch.save(value, stream)  # type: ignore[arg-type]  # a writable file object: all torch.save needs
        except RuntimeError as exc:
            failure = stream.failure
            if failure is None:
                raise
            # torch's "unexpected pos" came after the write that failed under it: that one says why
            code = failure.errno or errno.EIO
            raise OSError(code, os.strerror(code), str(path)) from exc


def save_tensors(write: Callable[[str], None], path: Path) -> None:
    """Run ``write(str(path))``, a safetensors save; a write the system refuses raises an OSError naming ``path``.

    The file lands with the mode a plain ``open(path, "w")`` gives it (0o666 less the umask, or the mode of
    the file it overwrites): safetensors makes its file 0o600, readable by its owner alone.
    """
    mode = None if is_stream(path) else _plain_mode(path)
    try:
        write(str(path))
        if mode is not None and stat.S_IMODE(path.stat().st_mode) != mode:
            os.chmod(path, mode)
    except SafetensorError as exc:
        if "I/O error" not in str(exc) and "IoError" not in str(exc):
            raise
        found = _OS_ERROR.search(str(exc))
        code = int(found.group(1)) if found else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from exc


def _plain_mode(path: Path) -> int:
    """The mode a plain write leaves ``path`` with: the mode it has, made as ``open`` makes it if it is not there."""
    with open(path, "ab"):
        pass
    return stat.S_IMODE(path.stat().st_mode)


class _Recording:
    """A file torch.save writes through, keeping the OSError of the write that failed (torch reports another)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.failure: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.handle.write(data))
        except OSError as exc:
            self.failure = self.failure or exc
            raise

    def flush(self) -> None:
        self.handle.flush()
