"""Stopping a run cleanly on SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("redline")


class StopOnSignal:
    """While fit() runs, SIGTERM/SIGINT ask the loop to stop after the current step (a second SIGINT aborts)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        self.received, self.previous = None, {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        log.warning("%s: finishing this step, then writing a checkpoint", signal.Signals(signum).name)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
