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

from redline.errors import StoppedBySignal

SAID = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


class _Terminated(BaseException):
    """SIGTERM, raised as Ctrl-C raises KeyboardInterrupt: not an Exception, so code that wraps the user's errors
    (a model factory's, a forward's) lets it pass, as it lets Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stopped_by_signal(doing: str, outcome: str) -> Iterator[None]:
    """Inside, SIGTERM and Ctrl-C raise StoppedBySignal: "stopped by SIGTERM while {doing}: {outcome}".

    Its exit code is 128 + the signal's number (143, 130), as the shell gives a process a signal
    stopped. Outside the main thread signals are not ours to take, and the handlers stay as they are.
    """

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise _Terminated(signum)

    taken = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if taken else None
    try:
        yield
    except (KeyboardInterrupt, _Terminated) as exc:  # Ctrl-C keeps Python's own handler, which libraries expect
        signum = exc.signum if isinstance(exc, _Terminated) else signal.SIGINT
        raise StoppedBySignal(signum, f"stopped by {SAID[signal.Signals(signum)]} while {doing}: {outcome}") from None
    finally:
        if taken:
            signal.signal(signal.SIGTERM, previous)
