"""Stopping a run cleanly on SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from redline.errors import first_to_say
from redline.train.failures import RESUME_AGAIN

log = logging.getLogger("redline")
NO_OUT = "the run has no --out, out_dir"
NO_CHECKPOINT = f"without a checkpoint ({NO_OUT})"
RESULTS = "the final evaluation, sample, summary.json and model.safetensors"  # what a run with out_dir ends with
UNSAVED = "the final evaluation, sample and summary"  # a run without out_dir's: nothing written


class StopOnSignal:
    """While fit() runs, SIGTERM/SIGINT ask the loop to stop after the current step (a second SIGINT aborts); one
    the process ignores (it was started so) stays ignored.

    The handler only records the signal: writing from it (a log line) could land inside a write the
    main thread was making to the same stream, which Python refuses with "reentrant call"
    (https://docs.python.org/3/library/signal.html#note-on-signal-handlers-and-exceptions). The loop
    reports it with ``announce()`` after the step; once the steps are done (``finishing``), a thread that
    waits for it reports it at once, as no step follows.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}
        self._announced: int | None = None
        self._finishing: tuple[threading.Thread, threading.Event, str | None] | None = None  # None: nothing kept
        self._late: int | None = None  # the first signal, where it came once the steps were done

    def __enter__(self) -> StopOnSignal:
        self.received, self.previous, self._announced, self._finishing, self._late = None, {}, None, None, None
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            # one the process was started ignoring stays ignored, as Python leaves it: a shell's background job
            # (`redline train ... &` in a script) ignores SIGINT, so that a Ctrl-C to the job in front spares it
            for signum in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(signum) != signal.SIG_IGN:
                    self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            if self._late is not None and self._finishing is not None:
                raise ResultsSkipped(_skipped(self._finishing[2]))
            raise KeyboardInterrupt
        if self._finishing is not None and self.received is None:
            self._late = signum
            self._finishing[1].set()  # its thread says so: a handler must not write
        self.received = signum

    def finishing(self, kept: str | None, *, by_signal: bool) -> None:
        """Mark the steps done, and kept in checkpoint ``kept`` (None: the run has no out_dir): the run now writes
        its results (the final evaluation, the sample, the summary and weights). Where its work was done (not
        ``by_signal``), a signal from here on, or one its last step brought, is said at once, with what a second
        Ctrl-C does (not that the run stops after this step, which no step follows); a run stopping for a signal
        said so after its step."""
        if self._finishing is not None:
            return
        if by_signal or not self.previous:  # no handler of ours: another thread's fit
            self.announce(checkpointing=kept is not None)  # a signal's last step said so, unless another came since
            return
        told = threading.Event()
        teller = threading.Thread(target=self._tell_late, args=(told,), name="redline-signal", daemon=True)
        self._finishing = teller, told, kept
        if self.received is not None:  # it came in the last step, whose stop was its work's end
            self._late = self.received
            told.set()
        teller.start()

    def _tell_late(self, told: threading.Event) -> None:
        told.wait()
        if self._late is None or self._finishing is None:  # woken by __exit__: no signal came
            return
        name, kept = signal.Signals(self._late).name, self._finishing[2]
        if self._late != signal.SIGINT:
            message = f"{name}: the run has finished its steps; it exits once its results are written"
        elif kept is not None:
            message = (
                f"{name}: the run has finished its steps and is writing its results ({RESULTS}); a second Ctrl-C "
                f"skips them{_kept(kept)}"
            )
        else:
            message = f"{name}: the run has finished its steps and is ending ({UNSAVED}); a second Ctrl-C skips them"
        if first_to_say(message):
            log.warning("%s", message)

    def announce(self, checkpointing: bool = True, *, after: str = "this step") -> None:
        """Log, once per signal and outside the handler, that the run stops ``after`` this step (or evaluation; and
        whether a checkpoint follows); under the launcher, once for the workers of a machine, whose signal is the
        same."""
        if self.received is not None and self.received != self._announced:
            self._announced = self.received
            then = "then writing a checkpoint" if checkpointing else NO_CHECKPOINT
            message = f"{signal.Signals(self.received).name}: stopping after {after}, {then}"
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
        if self._finishing is not None:  # after the handlers: none of ours sets the event any more
            teller, told, _ = self._finishing
            told.set()
            teller.join(timeout=5)


class ResultsSkipped(KeyboardInterrupt):
    """A second Ctrl-C once the steps were done: the run's results (final evaluation, summary, weights) are not
    written; its last checkpoint (the message names it) holds every step, and a resume writes them."""


def _kept(checkpoint: str) -> str:
    """What a second Ctrl-C after the last step leaves: the steps, kept in ``checkpoint``, and how to go on."""
    return f"; every step is kept in {checkpoint}: {RESUME_AGAIN} to write them"


def _skipped(checkpoint: str | None) -> str:
    """ResultsSkipped's message: what the second Ctrl-C skipped, and what is left (the steps, in ``checkpoint``)."""
    if checkpoint is None:
        return f"a second Ctrl-C after the run's last step skipped {UNSAVED}; nothing was saved: {NO_OUT}"
    return f"a second Ctrl-C after the run's last step skipped its results ({RESULTS}){_kept(checkpoint)}"
