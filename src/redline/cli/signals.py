"""Stopping a command on SIGTERM or Ctrl-C with a word: what it was doing and what it leaves behind.

Python's own default for SIGTERM ends the process at once, without a line, and its KeyboardInterrupt
ends a command with a bare exit code: a user who stops `redline serve` while it loads a large model,
or a scheduler that stops `redline predict`, learns nothing of what happened.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from redline.errors import StoppedBySignal, Terminated, interrupting_signal

SAID = {signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP", signal.SIGINT: "Ctrl-C"}


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises Terminated, a KeyboardInterrupt: what a command does on Ctrl-C it does on SIGTERM.

    So does SIGHUP (the terminal closed, an ssh session dropped), whose default ends the process without a
    word and leaves a temporary file behind. A signal the process was started ignoring (SIGHUP under ``nohup``,
    SIGTERM from a parent that ignores it) stays ignored: that is the user's choice, as Python leaves it.
    Outside the main thread signals are not ours to take, and the handlers stay as they are.
    """

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = [signal.SIGTERM] * (signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN)
    taken += [signal.SIGHUP] * (signal.getsignal(signal.SIGHUP) is signal.SIG_DFL)
    previous = {signum: signal.signal(signum, terminate) for signum in taken}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def stopped_by_signal(doing: str, outcome: str | Callable[[KeyboardInterrupt], str]) -> Iterator[None]:
    """Inside, SIGTERM, SIGHUP and Ctrl-C raise StoppedBySignal: "stopped by SIGTERM while {doing}: {outcome}".

    Its exit code is 128 + the signal's number (143, 129, 130), as the shell gives a process a signal stopped.
    ``outcome`` may be a function of the interrupt, for what was done by then.
    """
    try:
        with terminate_as_interrupt():
            yield
    except KeyboardInterrupt as exc:  # Ctrl-C keeps Python's own handler, which libraries expect
        signum = interrupting_signal(exc)
        left = outcome(exc) if callable(outcome) else outcome
        raise StoppedBySignal(signum, f"stopped by {SAID[signal.Signals(signum)]} while {doing}: {left}") from None
