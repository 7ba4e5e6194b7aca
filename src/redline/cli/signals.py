"""Stopping a command on SIGTERM or Ctrl-C with a word: what it was doing and what it leaves behind.

Python's own default for SIGTERM ends the process at once, without a line, and its KeyboardInterrupt
ends a command with a bare exit code: a user who stops `redline serve` while it loads a large model,
or a scheduler that stops `redline predict`, learns nothing of what happened.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from redline.errors import StoppedBySignal, Terminated, interrupting_signal

SAID = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises Terminated, a KeyboardInterrupt: what a command does on Ctrl-C it does on SIGTERM.

    Outside the main thread signals are not ours to take, and the handler stays as it is.
    """

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)

    taken = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if taken else None
    try:
        yield
    finally:
        if taken:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stopped_by_signal(doing: str, outcome: str) -> Iterator[None]:
    """Inside, SIGTERM and Ctrl-C raise StoppedBySignal: "stopped by SIGTERM while {doing}: {outcome}".

    Its exit code is 128 + the signal's number (143, 130), as the shell gives a process a signal stopped.
    """
    try:
        with terminate_as_interrupt():
            yield
    except KeyboardInterrupt as exc:  # Ctrl-C keeps Python's own handler, which libraries expect
        signum = interrupting_signal(exc)
        raise StoppedBySignal(signum, f"stopped by {SAID[signal.Signals(signum)]} while {doing}: {outcome}") from None
