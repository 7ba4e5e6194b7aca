"""A second Ctrl-C aborts a launched job as it aborts a run in one process: the workers get it as SIGINT.

torchrun's agent meets the first stopping signal by sending it on to the workers and waiting (30 s) for them
to exit. A second Ctrl-C raised inside that wait, and the agent's clean-up then sent the workers SIGTERM
(``SimpleElasticAgent.run``'s ``finally`` calls ``_shutdown()``, whose signal defaults to SIGTERM), which
the Trainer takes as one more reason to stop: the job carried on stopping, through its checkpoint, final
evaluation and results. Here every SIGINT after the first stopping signal is passed on to the workers as
itself, whose own rule is that a second one aborts them, and the agent's wait goes on until they exit.

The terminal's Ctrl-C reaches the launcher alone: torchrun starts each worker in a session of its own, so
each Ctrl-C reaches a worker once, through the launcher. One Ctrl-C may still reach the launcher several times
within milliseconds (``timeout`` passes on the SIGINT the terminal sent its whole group): a SIGINT within
SAME_CTRL_C_S of the first stopping signal is that one again, not a second.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from redline.launch.stopped import Aborted
from redline.parallel.env import FINISHING, interrupted_mark

_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SAME_CTRL_C_S = 0.5  # a person's second Ctrl-C comes later; copies of one signal come within milliseconds


class Interrupts:
    """The SIGINTs a launcher received once its workers began to stop, each passed on to them (``passing_on``).

    Before the first is passed on the launcher marks it beside the workers' ``finished`` file (``interrupted_mark``):
    a worker that a second SIGINT aborts then leaves it to the launcher to say what the run saved, once for the job
    (rank 1 is not told of rank 0's checkpoints), and marks whether the run's steps were done (``finishing``).
    """

    def __init__(self, finished: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.mark = interrupted_mark(finished)
        self.clock = clock
        self.stopping = False  # torchrun's agent is stopping the workers, for a first signal
        self.first_at = 0.0  # when the first stopping signal came, on ``clock``
        self.count = 0  # the SIGINTs received from the first stopping signal on (the first among them)

    @property
    def aborted(self) -> Aborted | None:
        """What a second SIGINT as the workers stopped aborted: the run's stop, or the writing of its results where a
        worker marked that its steps were done; None where no second came."""
        if self.count < 2:
            return None
        try:
            return "finishing" if self.mark.read_text() == FINISHING else "stopping"
        except OSError:
            return "stopping"

    @contextlib.contextmanager
    def passing_on(self) -> Iterator[None]:
        """Within the block, torchrun's agent stops the workers on a first signal as before, and a SIGINT after it
        goes to the workers as SIGINT. Without Linux's /proc, or where torch no longer has the handler it installs, its
        own handling stays."""
        from torch.distributed.elastic.multiprocessing import api

        # torchrun installs this function as its signal handler each time it starts workers (PContext.start), by
        # its module's name: the one found there then is installed
        original = getattr(api, "_terminate_process_handler", None)
        if original is None or not Path("/proc/self/stat").exists():  # no /proc to find the workers in
            yield
            return

        # one the launcher was started ignoring stays ignored, as Python leaves it: a script's background job
        # (`redline launch ... &`) ignores SIGINT, where torchrun would take it over as it starts the workers
        ignored = {signum for signum in _STOPPING if signal.getsignal(signum) is signal.SIG_IGN}

        def handle(signum: int, frame: FrameType | None) -> None:
            if signum in ignored:
                return
            if self.stopping and signum == signal.SIGINT and self.clock() - self.first_at < SAME_CTRL_C_S:
                return  # the first one again, passed on by a process between the terminal and the launcher
            self.count += signum == signal.SIGINT
            if self.stopping and signum == signal.SIGINT:
                with contextlib.suppress(OSError):
                    self.mark.touch()
                for worker in _workers():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(worker, signal.SIGINT)  # its group, as torchrun signals it: its loader workers too
                return  # the agent's wait for the workers goes on
            self.stopping, self.first_at = True, self.clock()
            original(signum, frame)  # raises SignalException: the agent sends the signal on and waits

        api._terminate_process_handler = handle
        try:
            yield
        finally:
            api._terminate_process_handler = original


def _workers() -> list[int]:
    """This process's children that lead a process group of their own, as torchrun starts its workers (from /proc)."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # after the command's name: state, ppid, pgrp
            pid = int(stat.parent.name)
            if int(fields[1]) == me and int(fields[2]) == pid:
                found.append(pid)
        except (OSError, ValueError, IndexError):  # a process that ended as it was read
            continue
    return found
