"""Ctrl-C and SIGTERM stop a launcher that waits for the other machines of its job.

torchrun's rendezvous waits for every machine inside torch's C++ store (up to its timeout, minutes),
where Python's signal handlers do not run until the wait ends: Ctrl-C did nothing. Python's C-level
handler still writes the signal's number to the wakeup fd the moment it arrives (``signal.set_wakeup_fd``),
so a thread reading that fd sees it at once. While no worker has started (torchrun installs its own
SIGINT and SIGTERM handlers when it starts them, and from then on passes a signal on to them), nothing is lost by
ending the launcher there, and the thread does, exiting as the signal asks (128 + its number).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType

log = logging.getLogger("redline")
_STOPPING = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stoppable_while_waiting(what: str, cleanup: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Within the block, let SIGINT or SIGTERM end the process while no worker has started; ``what`` is waited for.

    Call it from the main thread. ``cleanup`` runs before the process ends (it exits without unwinding).
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets the wakeup fd
        yield
        return
    # Python's default for SIGTERM kills at once, past the wakeup fd, which only a handler of Python's is written
    # to: one that does nothing lets the thread below see it
    defaults = [signum for signum in _STOPPING if signal.getsignal(signum) is signal.SIG_DFL]
    for signum in defaults:
        signal.signal(signum, _seen)
    before = {signum: signal.getsignal(signum) for signum in _STOPPING}  # torchrun replaces them as workers start
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # as set_wakeup_fd requires
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        while data := _receive(reader):
            for signum in data:
                if signum in _STOPPING and all(signal.getsignal(s) is handler for s, handler in before.items()):
                    _end(signal.Signals(signum), what, cleanup)

    thread = threading.Thread(target=watch, name="redline-launch-waiting", daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        writer.close()  # the thread's read returns empty: it ends
        thread.join(timeout=5)
        reader.close()
        for signum in defaults:
            if signal.getsignal(signum) is _seen:  # not once torchrun has put its own in place
                signal.signal(signum, signal.SIG_DFL)


def _seen(signum: int, frame: FrameType | None) -> None:
    """A handler that leaves a stopping signal to the thread reading the wakeup fd."""


def _receive(reader: socket.socket) -> bytes:
    try:
        return reader.recv(64)
    except OSError:  # closed under it: the block is over
        return b""


def _end(signum: signal.Signals, what: str, cleanup: Callable[[], None]) -> None:
    log.error(
        "stopped by %s while waiting for %s: no worker had started, so nothing is lost\n"
        "hint: start the same command on every machine of the job, then run this one again",
        signum.name, what,
    )  # fmt: skip
    with contextlib.suppress(Exception):
        cleanup()
    logging.shutdown()  # flush what was said: the process ends without unwinding
    os._exit(128 + signum)
