"""One run at a time in an out_dir: rank 0 holds an advisory lock on ``OUT/.lock`` for the whole fit.

Two runs writing one out_dir would prune each other's checkpoints, remove each other's staging
directories and interleave their logs; the second is refused at once instead. The lock is an
``flock``, which the kernel lets go when its process ends, however it ends: a run killed with
SIGKILL leaves no lock behind, only the file, which stays (emptied when a run lets go of it), since
removing it would let two runs lock two different files of one name. Where there is no ``fcntl``
(Windows), or the file system refuses locks, runs are not kept apart.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from redline.errors import ConfigError, invalid
from redline.parallel.collectives import run_on_rank0

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks
    fcntl = None  # type: ignore[assignment]

LOCK = ".lock"

log = logging.getLogger("redline")


@contextlib.contextmanager
def holding_out_dir(out_dir: Path | None) -> Iterator[None]:
    """Hold ``out_dir``'s lock (on rank 0) while the block runs; refuse at once, on every rank alike, where another
    run holds it. Collective under several processes."""
    if out_dir is None or fcntl is None:
        yield
        return
    with contextlib.ExitStack() as held:
        run_on_rank0(lambda: held.enter_context(_locked(out_dir)), "locking out_dir")
        yield


@contextlib.contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    """Lock ``out_dir / LOCK`` and write this process's pid and host in it; raise ConfigError where it is held."""
    path = out_dir / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        _unlocked(path, exc)
        yield
        return
    try:
        locked = _lock(fd, path, out_dir)
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            _HELD.add(fd)
            _close_in_children()
        try:
            yield
        finally:
            if locked:
                _HELD.discard(fd)
                os.ftruncate(fd, 0)  # nobody holds it now
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# The descriptors of the locks this process holds. A forked child (a DataLoader worker) shares each, and a flock
# lasts while any process has it open: the child closes its copies at once, so that a run killed with SIGKILL
# leaves no lock behind in workers that outlive it for a while.
_HELD: set[int] = set()


@functools.cache
def _close_in_children() -> None:
    os.register_at_fork(after_in_child=_forget_held)  # once, at the first lock: importing registers nothing


def _forget_held() -> None:
    """In a forked child: close the copies of the held locks' descriptors (its parent keeps the locks)."""
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


def _lock(fd: int, path: Path, out_dir: Path, *, quiet: bool = False) -> bool:
    """Take the lock on ``fd`` without waiting; False where the file system has no locks (the run goes on, warned
    unless ``quiet``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise in_use(out_dir, os.pread(fd, 256, 0).decode(errors="replace")) from None
    except OSError as exc:  # a network file system without locks, say
        if not quiet:
            _unlocked(path, exc)
        return False
    return True


def in_use(out_dir: Path, holder: str) -> ConfigError:
    """The error of an ``out_dir`` another run holds; ``holder`` is what its lock file says ("PID HOST")."""
    pid, _, host = holder.strip().partition(" ")
    who = "another run"
    if pid.isdigit():
        who += f" (pid {pid}" + (f" on {host})" if host and host != socket.gethostname() else ")")
    return invalid(
        "out_dir",
        str(out_dir),
        f"a directory no other run is writing in; {who} is writing its checkpoints and logs there now",
        "wait for that run to end (resume='auto' then continues it), or pass another out_dir=DIR",
    )


def refuse_if_held(out_dir: Path | None) -> None:
    """Refuse at once, as the run itself would, where another run holds ``out_dir``'s lock; take nothing.

    A launcher asks before it starts its workers: else the workers would start, load the task and be refused,
    and be restarted to be refused again, once per --max-restarts.
    """
    if out_dir is None or fcntl is None:
        return
    path = out_dir / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file, so no holder; or one this process cannot read, which the run will report
        return
    try:
        if _lock(fd, path, out_dir, quiet=True):
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _unlocked(path: Path, exc: OSError) -> None:
    log.warning(
        "%s cannot be locked (%s): another run started with this out_dir would not be refused", path,
        exc.strerror or exc,
    )  # fmt: skip
