"""A Ctrl-C that Python drops (raised inside a weakref callback or __del__, as torch.compile runs many) is not lost."""

from __future__ import annotations

import gc
import os
import signal
import sys

import pytest

from dropped_interrupts import DropsItsInterrupt
from redline.errors import Terminated, noting_interrupts


@pytest.fixture
def dropped(monkeypatch) -> list[type[BaseException]]:
    """The exceptions Python drops (its "Exception ignored in" hook), by type."""
    found: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: found.append(unraisable.exc_type))
    return found


def raising_sigterm(signum, frame):
    raise Terminated(signum)


def test_an_interrupt_python_drops_is_noted_and_raised_again(dropped):
    with noting_interrupts() as noted:
        DropsItsInterrupt(signal.SIGINT)  # deleted at once: no KeyboardInterrupt reaches this block
        gc.collect()
        assert dropped == [KeyboardInterrupt]  # Python printed it and went on
        with pytest.raises(KeyboardInterrupt) as raised:
            noted.raise_lost()
        assert type(raised.value) is KeyboardInterrupt
        noted.raise_lost()  # raised once: nothing is left
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupt_the_caller_caught_is_forgotten_and_sigterm_comes_back_as_terminated(dropped):
    before = signal.signal(signal.SIGTERM, raising_sigterm)  # as the command line takes SIGTERM (cli/signals.py)
    hung_up = signal.signal(signal.SIGHUP, raising_sigterm)  # and SIGHUP
    try:
        with noting_interrupts() as noted:
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):
                    pass
            noted.caught()
            noted.raise_lost()  # caught: nothing to raise again
            DropsItsInterrupt(signal.SIGTERM)
            assert dropped == [Terminated]
            with pytest.raises(Terminated) as raised:
                noted.raise_lost()
            assert raised.value.signum == signal.SIGTERM
            DropsItsInterrupt(signal.SIGHUP)  # the terminal closed: the command line takes it as Ctrl-C too
            with pytest.raises(Terminated) as raised:
                noted.raise_lost()
            assert raised.value.signum == signal.SIGHUP
        assert signal.getsignal(signal.SIGTERM) is raising_sigterm
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGHUP, hung_up)


def test_a_handler_that_raises_nothing_and_an_ignored_signal_are_left_alone(dropped):
    seen = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))  # a handler of the caller's own
    try:
        with noting_interrupts() as noted:
            DropsItsInterrupt(signal.SIGINT)
            noted.raise_lost()  # the handler ran and raised nothing: nothing was lost
        assert seen == [signal.SIGINT] and dropped == []
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with noting_interrupts():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
