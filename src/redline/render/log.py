"""redline's one voice on the terminal: the records of ``logging.getLogger("redline")``, rendered by rich.

The library only logs; the command line calls ``show_logs()`` once. A record prints as its level
and its message on stderr, never wrapped or marked up, so a hint or a path prints as written.
"""

from __future__ import annotations

import logging

from rich.console import Console
from rich.text import Text

LOGGER = "redline"
_STYLES = {"DEBUG": "dim", "INFO": "cyan", "WARNING": "yellow", "ERROR": "bold red", "CRITICAL": "bold red"}


class ConsoleHandler(logging.Handler):
    """Print each record as ``warning: message`` on stderr, the level word coloured."""

    def __init__(self, console: Console | None = None) -> None:
        super().__init__()
        self.console = console or Console(stderr=True, soft_wrap=True, highlight=False)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = record.levelname.lower()
            self.console.print(Text.assemble((f"{level}: ", _STYLES.get(record.levelname, "")), record.getMessage()))
        except Exception:  # a log line must never end the run
            self.handleError(record)


def show_logs(level: int = logging.INFO) -> None:
    """Send redline's records at ``level`` and above to stderr through rich (once per process)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(handler, ConsoleHandler) for handler in logger.handlers):
        logger.addHandler(ConsoleHandler())
    logger.setLevel(level)
    logger.propagate = False  # printed here once, not again by a root handler the user set up
