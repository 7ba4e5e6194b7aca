"""The attention kernel a run prefers, timed on the model's own calls as it runs (``KernelCheck``).

A run whose ``attention`` was left to auto, where no trial timed the kernels before it, times them on its first
steps: in the bf16-mixed phase of a precision check (runtime/precision_check.py), or after the first training forward
of a run that starts in a reduced precision, recorded inside ``rt.autocast()``. Each kernel that takes the model's
calls runs them alone (runtime/attention.py, ``time_kernels``), within a stated budget, and one ``KEEP`` faster
than torch's pick is preferred from then on, while the Runtime runs, in the precision it was timed in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from redline.errors import describe_error
from redline.plan import Choice
from redline.runtime.attention import (
    AttentionCall,
    attention_kernels,
    prefer_kernel,
    recording,
    sdp_state,
    time_kernels,
)
from redline.runtime.precision import AUTOCAST_DTYPES

KEEP = 1.10  # a kernel replaces torch's pick where the model's attention calls run this much faster on it
TRIES = 3  # training forwards a run's first-forward check records before it takes the model for one without attention


@dataclass
class KernelCheck:
    """The attention kernel a run whose ``attention`` was left to auto prefers, timed on the model's own calls: each
    kernel that takes them runs them alone, and one ``KEEP`` faster than torch's pick is preferred from then on.

    Two runs check: the bf16-mixed phase of a precision check (runtime/precision_check.py), at the phase's first
    training forward, on the calls its comparison's forward recorded (the kernel stays if the precision does, and is
    dropped with it); and a run that starts in a reduced precision (``pending``), after its first training forward
    in ``rt.autocast()`` (``around``), on that forward's calls.
    """

    device: torch.device
    default: Choice[str]  # the axis as resolved: torch's pick per call
    chosen: Choice[str] | None = None
    budget_s: float | None = None  # the seconds the timing may take (the precision check's allowance left)
    pending: str | None = None  # the reduced precision of a run whose first training forward's calls are to be timed
    module: nn.Module | None = None  # the model whose training forwards (``module.training``) ``around`` records
    timed_in: str | None = None  # the precision the kernels were timed in: the kernel chosen runs only in it
    _following: str | None = None  # the precision the run's steps are in now, where a precision check switches it
    _flags: tuple[tuple[bool, ...], tuple[int, ...]] = field(default_factory=sdp_state)  # torch's, at set-up
    _kernel: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _holds: int = 0  # the ``held`` contexts open
    _recording: bool = False  # an ``around`` context records now (one inside it, around the loss say, does not)
    _tries: int = 0  # training forwards recorded that made no attention call

    def around(self, autocast: contextlib.AbstractContextManager[Any]) -> contextlib.AbstractContextManager[Any]:
        """``autocast`` (``rt.autocast()``'s context), recording the attention calls made inside while a check is
        ``pending``; they are timed when it closes (``_Watched``)."""
        return _Watched(self, autocast) if self.pending is not None else autocast

    def check(self, calls: Sequence[AttentionCall], precision: str) -> None:
        if self.chosen is not None or not calls:
            return
        began, self.timed_in = time.perf_counter(), precision
        try:
            kernels, timed = time_against_pick(calls, self.device, precision, budget_s=self.budget_s)
            if len(kernels) == 1:  # nothing to set against torch's pick (on a CPU, math alone takes dropout)
                self.chosen = Choice(
                    self.default.value,
                    f"{self.default.reason}; no other kernel takes the model's attention calls ({len(calls)}) under "
                    f"{precision}",
                )
                return
        except Exception as exc:  # never the user's step's failure: torch's pick stays, and the Plan says why
            why = describe_error(exc)
            self.chosen = Choice(self.default.value, f"{self.default.reason}; the kernels could not be timed ({why})")
            return
        spent = time.perf_counter() - began
        if None not in timed or len(timed) < 2:  # the allowance ran out before a kernel could be set against torch's
            self.chosen = Choice(
                self.default.value,
                f"{self.default.reason}; torch's pick kept: timing the kernels of the model's attention calls "
                f"({len(calls)}) would take longer than the {self.budget_s or 0:.2g} s the check left for it",
            )
            return
        best, ratio = preferred(timed)
        told = ", ".join(f"{k or 'torch pick'} {_ms(timed[k])}" for k in timed)
        untimed = [k for k in kernels if k not in timed]
        if untimed:
            told += f" ({', '.join(map(str, untimed))} not timed within the check's {self.budget_s or 0:.2g} s)"
        what = (
            f"the model's attention calls ({len(calls)}) under {precision}, forward and backward, timed alone in "
            f"{spent:.2g} s: {told}"
        )
        if best is None:
            self.chosen = Choice(
                self.default.value, f"{self.default.reason}; measured on this run, torch's pick kept: {what}"
            )
            return
        self.chosen = Choice(best, f"measured on this run: {best} ran {ratio:.2f}x torch's pick ({what})")
        self._apply()  # from the next forward, where the run is on (else from ``held``)

    def follow(self, precision: str) -> None:
        """The run's steps go on in ``precision`` (a precision check's switch): the kernel chosen runs only in the
        precision it was timed in, and comes back with it."""
        self._following = precision
        self._apply()

    def _apply(self) -> None:
        """Prefer the kernel chosen where it runs now: the Runtime on (``held``), a kernel other than torch's pick,
        and the run's steps in the precision it was timed in; else torch's own flags."""
        self._kernel.close()
        chosen = self.chosen.value if self.chosen is not None else self.default.value
        if self._holds and chosen != self.default.value and self._following in (None, self.timed_in):
            self._kernel.enter_context(prefer_kernel(chosen))

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Prefer the kernel chosen while inside (or from when ``check`` chooses it inside); torch's own flags after the
        outermost exit, the kernel still chosen (a paused Runtime's, until it runs again)."""
        self._holds += 1
        if self._holds == 1:
            self._apply()
        try:
            yield
        finally:
            self._holds -= 1
            if self._holds == 0:
                self._kernel.close()

    def drop(self, why: str) -> None:
        """Go back to torch's pick, for ``why`` (the precision kept is another)."""
        self._kernel.close()
        if self.chosen is None:
            return
        if self.chosen.value != self.default.value:
            self.chosen = Choice(self.default.value, f"{self.default.reason}; {self.chosen.reason}, but {why}")
        elif not self.chosen.reason.endswith(why):
            self.chosen = Choice(self.chosen.value, f"{self.chosen.reason}; {why}")


def time_against_pick(
    calls: Sequence[AttentionCall], device: torch.device, precision: str, *, budget_s: float | None = None
) -> tuple[list[str | None], dict[str | None, float]]:
    """The kernels worth setting against torch's pick for ``calls`` (made in ``precision``'s dtype), torch's pick
    (None) first, and the seconds each took on them (``time_kernels``, within ``budget_s``); nothing is timed where no
    other kernel takes the calls."""
    kernels: list[str | None] = [None, *attention_kernels(calls, device, precision)]
    if len(kernels) == 1:
        return kernels, {}
    return kernels, time_kernels(calls, device, kernels, budget_s=budget_s)


def preferred(timed: dict[str | None, float]) -> tuple[str | None, float]:
    """The kernel to prefer from ``timed`` (None: torch's pick) and how many times faster than torch's pick it ran:
    the fastest, where it beat torch's pick by ``KEEP``; else torch's pick, and the fastest's ratio."""
    if None not in timed:
        return None, 1.0
    best = min(timed, key=lambda kernel: timed[kernel])
    ratio = timed[None] / timed[best]
    return (best, ratio) if best is not None and ratio >= KEEP else (None, ratio)


class _Watched:
    """``rt.autocast()``'s context while a ``KernelCheck`` is pending: a training forward inside it (autograd on, the
    model in training mode, the Runtime running) has its attention calls recorded, and timed when it closes, unless it
    raised; the kernel kept runs from the next forward on. Only the outermost such context records, and a forward
    that made no attention call leaves the check pending, ``TRIES`` times at most. A loop that sets its own kernels
    around its steps (torch's flags other than at set-up) is not checked: the loop chose."""

    def __init__(self, check: KernelCheck, autocast: contextlib.AbstractContextManager[Any]) -> None:
        self.check, self.autocast = check, autocast
        self._recording: contextlib.ExitStack | None = None
        self._calls: list[AttentionCall] = []

    def __enter__(self) -> Any:
        check = self.check
        ready = check.pending is not None and check._holds and not check._recording and torch.is_grad_enabled()
        if ready and (check.module is None or check.module.training):
            if sdp_state() != check._flags:
                check.pending = None
                check.chosen = Choice(
                    check.default.value,
                    f"{check.default.reason}; not timed on this run: the loop sets its own attention kernels",
                )
            else:
                self._recording, check._recording = contextlib.ExitStack(), True
                self._calls = self._recording.enter_context(recording())
        return self.autocast.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.autocast.__exit__(*exc)
        finally:
            stack, self._recording = self._recording, None
            if stack is not None:
                stack.close()  # the recorder leaves torch's mode stack, whatever happened inside
                self.check._recording = False
                self._done(failed=exc[0] is not None)

    def _done(self, *, failed: bool) -> None:
        check, precision = self.check, self.check.pending
        if failed or precision is None:
            return
        if not self._calls or any(call.dtype != AUTOCAST_DTYPES[precision] for call in self._calls):
            check._tries += 1  # no attention, or a forward in another precision (a precision check's phase)
            check.pending = None if check._tries >= TRIES else precision
            return
        check.pending = None
        check.check(self._calls, precision)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.3g} ms"
