"""A load test's stop signals: the first SIGINT or SIGTERM ends the run early with what it measured (a second
Ctrl-C ends the process at once, a second SIGTERM is the same stop), and the handlers the caller had are given back
when it ends (serve/loadtest.py)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_stop_signals(stop: Callable[[signal.Signals], None]) -> dict[signal.Signals, Any]:
    """Call ``stop`` with the first SIGINT or SIGTERM, then give SIGINT back its default (KeyboardInterrupt: a second
    Ctrl-C ends the process at once) and take a second SIGTERM as the same stop, as training does; return the
    handlers they had before, for ``give_back_signals``, or {} where they cannot be caught (not the main thread,
    or no signals on this loop).

    A run under a scheduler or timeout(1) gets SIGTERM: ended at once, it would report nothing of what it measured.
    timeout(1) sends it twice, to the process and then to its group, so a second one is no one's wish to hurry.
    """
    loop = asyncio.get_running_loop()
    stopped = False

    def on_signal(signum: signal.Signals) -> None:
        nonlocal stopped
        if signal.SIGINT in before:
            loop.remove_signal_handler(signal.SIGINT)
        if not stopped:
            stopped = True
            stop(signum)

    # one the process was started ignoring stays ignored, as Python leaves it (a script's background job)
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    before = {signum: handler for signum, handler in before.items() if handler is not signal.SIG_IGN}
    try:
        for signum in before:
            loop.add_signal_handler(signum, on_signal, signum)
    except (RuntimeError, ValueError, NotImplementedError):  # the first fails where the second would
        return {}
    return before


def give_back_signals(before: dict[signal.Signals, Any]) -> None:
    """Give SIGINT and SIGTERM back the handlers they had before the run (a service's own, run_load's caller's):
    the loop's removal would leave torch's and Python's defaults in their place."""
    loop = asyncio.get_running_loop()
    for signum, handler in before.items():
        loop.remove_signal_handler(signum)
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
