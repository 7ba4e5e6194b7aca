"""Writing files and directories so that a crash at any moment leaves either the old one or the new one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries (its new files and renames), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_directory(tmp: Path, final: Path) -> None:
    """Rename the finished directory ``tmp`` to ``final``; an existing ``final`` is replaced.

    A rename is atomic. An older directory of the same name (a resumed run writing the same step
    again) is moved aside first and removed after, so a crash in between leaves one of the two.
    """
    if final.exists():
        aside = final.with_name(f".old-{final.name}-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
        tmp.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_path(final.parent)


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through a temporary file in the same directory, fsynced, then renamed into place."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
