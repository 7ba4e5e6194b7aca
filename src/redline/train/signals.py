"""Stopping a run cleanly on SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from redline.errors import first_to_say

log = logging.getLogger("redline")
NO_CHECKPOINT = "without a checkpoint (the run has no --out, out_dir)"


class StopOnSignal:
    """While fit() runs, SIGTERM/SIGINT ask the loop to stop after the current step (a second SIGINT aborts).

    The handler only records the signal: writing from it (a log line) could land inside a write the
    main thread was making to the same stream, which Python refuses with "reentrant call"
    (https://docs.python.org/3/library/signal.html#note-on-signal-handlers-and-exceptions). The loop
    reports it with ``announce()`` after the step.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}
        self._announced: int | None = None

    def __enter__(self) -> StopOnSignal:
        self.received, self.previous, self._announced = None, {}, None
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def announce(self, checkpointing: bool = True) -> None:
        """Log, once per signal and outside the handler, that the run stops after this step (and whether a
        checkpoint follows); under the launcher, once for the workers of a machine, whose signal is the same."""
        if self.received is not None and self.received != self._announced:
            self._announced = self.received
            then = "then writing a checkpoint" if checkpointing else NO_CHECKPOINT
            message = f"{signal.Signals(self.received).name}: stopping after this step, {then}"
            if first_to_say(message):
                log.warning("%s", message)

    def reason(self, distributed: bool) -> str:
        """The summary's ``stopped`` for a run a signal stops: which one, or, in a distributed run, that every rank
        agreed (a rank may stop for another's signal)."""
        if distributed:
            return "signal (agreed by all ranks)"
        return f"signal {signal.Signals(self.received or signal.SIGTERM).name}"

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
