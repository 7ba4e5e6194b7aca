"""Writing files and directories so that a crash at any moment leaves either the old one or the new one."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import secrets
import shutil
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from redline.errors import RedlineError, invalid


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
    again) is swapped with ``tmp`` in one step where the system can (Linux), then removed, so
    ``final`` always holds one of the two. Elsewhere it is moved aside first and removed after: a
    crash in between leaves the new one under ``tmp``'s name and the old one under ``aside_name``'s,
    for ``recover_directory`` to put back.
    """
    if final.exists() and _exchange(tmp, final):  # ``tmp`` now holds the old directory
        shutil.rmtree(tmp, ignore_errors=True)
    elif final.exists():
        aside = final.with_name(f"{ASIDE}{final.name}-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
        tmp.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_path(final.parent)


ASIDE = ".old-"  # an older directory moved aside by commit_directory: .old-NAME-PID


def recover_directory(aside: Path, tmp: Path, committed: Callable[[Path], bool]) -> Path | None:
    """Finish the replacement a crash cut short in ``commit_directory``; return the directory put in place, if any.

    ``aside`` is the older directory moved aside, ``tmp`` the new one's name before its rename;
    ``committed(tmp)`` says whether the new one was finished. Where the final name is taken, the
    replacement had finished and ``aside`` only goes.
    """
    final = aside.with_name(aside.name.removeprefix(ASIDE).rsplit("-", 1)[0])
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        return None
    if tmp.is_dir() and committed(tmp):
        tmp.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.rename(final)
    fsync_path(final.parent)
    return final


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (renameat2 with RENAME_EXCHANGE); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EXDEV):  # the kernel or file system lacks it
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def make_parent(path: Path) -> None:
    """Create ``path``'s directory and those missing above it, as ``redline train --out`` creates its own.

    A file where one of them would be raises NotADirectoryError whose ``filename`` is that file (mkdir
    itself would say "File exists", which names no culprit).
    """
    blocked = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise NotADirectoryError(errno.ENOTDIR, "a file is where a directory would be", str(blocked))
    path.parent.mkdir(parents=True, exist_ok=True)


def check_output(path: Path, name: str, example: str) -> None:
    """Refuse, before any work, an output ``path`` (the argument ``name``) that names a directory, lies under a
    file or cannot be written; create the folders it needs. ``example`` is a file name to suggest."""
    if path.is_dir():
        raise invalid(name, str(path), "a file, not a directory", f"e.g. {name}={str(path / example)!r}")
    if is_stream(path):  # /dev/null, a named pipe: written into as it is, so nothing is created beside it
        return
    try:
        make_parent(path)
        check_writable(path)
    except NotADirectoryError as exc:
        hint = "name a file in a directory, or a directory to create"
        raise invalid(name, str(path), f"a file in a directory; {exc.filename} is a file", hint) from None
    except OSError as exc:
        hint = "pass a file in a directory you can write to"
        raise invalid(name, str(path), f"a file you can write ({exc.strerror or exc})", hint) from exc


def check_writable(path: Path) -> None:
    """Create and remove a temporary file beside ``path``, as write_atomic does; raise its OSError where that fails.

    A command that writes its result at the end calls this first, so a read-only or missing place
    is refused before the work, not after it, when the result would be lost. A device or a named
    pipe is only asked whether it may be written (opening a pipe would wait for its reader).
    """
    if is_stream(path):
        if not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return
    _temporary_beside(_through_link(path)).unlink()


def _through_link(path: Path) -> Path:
    """The file a plain write to ``path`` changes: a link's target (a rename would replace the link itself)."""
    return path.resolve() if path.is_symlink() else path


HEAD_BYTES = 1 << 16  # what ``read_head`` reads: a file's kind shows in its first bytes


def read_head(path: Path) -> bytes:
    """The first ``HEAD_BYTES`` of the file ``path``, for telling what it holds."""
    with path.open("rb") as file:
        return file.read(HEAD_BYTES)


def refuse_replacing(path: Path, name: str, *, kind: str, holds: Callable[[Path], bool], example: str) -> None:
    """Refuse an output ``path`` (the argument ``name``) that holds a file other than an earlier ``kind`` (a run's
    model.safetensors, a script): the output would replace what it holds. An earlier output of the same kind
    (``holds(path)`` is true), an empty file, a missing one, a device or a pipe are written as they should be.
    A file ``holds`` cannot read is kept: what it holds is unknown. ``example`` is another file name to suggest."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        ours = holds(path)
    except (OSError, EOFError, ValueError):  # unreadable, or not the format it names (a .gz that is not gzip)
        ours = False
    if not ours:
        raise invalid(
            name, str(path), f"a new file, or an earlier {kind} to replace; this one holds something else",
            f"name another file, e.g. {name}={str(path.with_name(example))!r}, or delete {str(path)!r} first",
        )  # fmt: skip


def is_stream(path: Path) -> bool:
    """Whether ``path`` exists and is neither a regular file nor a directory: a device or a named pipe."""
    return path.exists() and not path.is_file() and not path.is_dir()


_OWNER = socket.gethostname().replace("/", "_") or "host"  # whose process a temporary file is: this machine's


def _sweep_stale(path: Path) -> None:
    """Remove the temporary files of ``path`` that a process of this machine killed mid-write left (SIGKILL, the
    OOM killer: no ``finally`` ran), told by their writer's pid, which no longer runs; another machine's, on
    shared storage, are left alone."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.{glob.escape(_OWNER)}-*-*.tmp"):
        pid = tmp.name.removesuffix(".tmp").rsplit("-", 2)[-2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its writer is gone: nothing will finish or remove it
            tmp.unlink(missing_ok=True)
        except OSError:  # another user's process runs under that pid: leave it
            continue


def _temporary_beside(path: Path) -> Path:
    """A new empty file in ``path``'s directory, hidden and named after it, for a write to go through.

    Created with the mode a plain ``open(path, "w")`` gives (0o666 less the umask): ``mkstemp``'s
    0o600 would leave every result, renamed into place, readable by its owner alone.
    """
    while True:
        tmp = path.parent / f".{path.name}.{_OWNER}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp


def write_or_refuse(
    path: Path, write: Callable[[Path], None], *, error: type[RedlineError], what: str = "", hint: str
) -> None:
    """``write_atomic``, where a write the system refuses (a full disk, a quota, storage gone read-only) is
    ``error`` naming the file (and ``what`` it holds), the cause and ``hint``; a file there before is kept."""
    try:
        write_atomic(path, write)
    except OSError as exc:
        raise error(
            f"{path}{what} could not be written: {exc.strerror or exc}; a file there before is left as it was\n"
            f"hint: {hint}"
        ) from exc


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through a temporary file in the same directory, fsynced, then renamed into place.

    It lands as a plain write would leave it: a file overwritten keeps its mode (one the user made private
    stays private), and a link keeps pointing at the file, which is written.
    A device or a named pipe (``/dev/null``, ``<(...)``) is written into as it is: a rename would put a
    regular file in its place (for every user of the machine, where it is /dev/null and we are root).
    """
    if is_stream(path):
        write(path)
        return
    path = _through_link(path)
    _sweep_stale(path)
    tmp = _temporary_beside(path)
    try:
        write(tmp)
        with contextlib.suppress(FileNotFoundError):  # a plain write keeps the mode of the file it overwrites
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
