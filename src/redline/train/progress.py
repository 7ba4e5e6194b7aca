"""Training progress for the person watching: a rich bar on a terminal, plain lines elsewhere, and never a crash.

A broken stream (closed, a pipe whose reader left) silences the progress output; the run goes on.
"""

from __future__ import annotations

import datetime
import sys
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

# What a failing write to the stream raises: ValueError for a closed file, OSError (BrokenPipeError) for a pipe.
STREAM_ERRORS = (OSError, ValueError)


class Progress:
    """Show the run's step, loss, throughput and ETA; call `update` every ``log_every`` steps.

    With ``enabled`` and a terminal ``stream`` (default: sys.stderr) it draws a rich bar, redrawn on each
    `update`; with another stream it writes one plain line per `update`; disabled, only `message` lines.
    The ETA is the steps left at the latest log window's step time, plus the run's evaluation, checkpoint and callback
    seconds per step so far (counted from ``start_step``): a compile and the first step's warm-up do not recur.
    """

    def __init__(
        self, total_steps: int, *, enabled: bool = True, stream: TextIO | None = None, start_step: int = 0
    ) -> None:
        self.total_steps = total_steps
        self.start_step = start_step
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr  # resolved now: tests and tools swap sys.stderr
        self._broken = False
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        if enabled and _is_terminal(self.stream):
            self._start_bar()

    def update(
        self,
        step: int,
        *,
        loss: float | None,
        samples_per_s: float | None,
        epoch: int,
        step_ms: float | None = None,
        excluded_s: float = 0.0,
    ) -> None:
        """Show the state at ``step``; ``epoch`` as the user counts it, ``None`` figures are left out. ``step_ms`` and
        ``excluded_s`` give the ETA (``eta_s``); without a step time there is none."""
        if not self.enabled or self._broken:
            return
        eta_s = self.eta_s(step, step_ms, excluded_s)
        status = _describe(epoch=epoch, loss=loss, samples_per_s=samples_per_s, eta_s=eta_s)
        if self._bar is None or self._task is None:
            self._write(f"step {step}/{self.total_steps}  {status}")
            return
        try:
            self._bar.update(self._task, completed=step, status=status)
            self._bar.refresh()
        except STREAM_ERRORS:
            self._broken = True

    def message(self, text: str) -> None:
        """Write ``text`` on its own line (above the bar, if one is drawn), even when progress is disabled."""
        if self._broken:
            return
        if self._bar is None:
            self._write(text)
            return
        try:
            self._bar.console.print(text, markup=False, highlight=False)
        except STREAM_ERRORS:
            self._broken = True

    def eta_s(self, step: int, step_ms: float | None, excluded_s: float = 0.0) -> float | None:
        """Return the seconds left after ``step``: each step left takes ``step_ms`` (the latest log window's step
        time) plus its share of ``excluded_s`` (the seconds spent outside the steps since ``start_step``: evaluation,
        checkpoints, callbacks). None without a step time (no step timed yet)."""
        done = step - self.start_step
        if step_ms is None or done <= 0:
            return None
        return max(0, self.total_steps - step) * (step_ms / 1e3 + excluded_s / done)

    def close(self) -> None:
        """Stop the bar, leaving its last state on screen; safe to call twice."""
        bar, self._bar = self._bar, None
        if bar is None:
            return
        try:
            bar.stop()
        except STREAM_ERRORS:
            self._broken = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _start_bar(self) -> None:
        # rich is imported here, not at module level: `import redline` must not load it.
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn
        from rich.progress import Progress as RichProgress

        # force_terminal: we already decided this stream is a terminal; rich's own guess also reads env vars.
        console = Console(file=self.stream, force_terminal=True)
        # No auto-refresh thread: the bar moves when update() brings numbers, and no thread writes behind the run.
        # No stdout/stderr redirect: the user's own prints must not go through a console whose stream may break.
        bar = RichProgress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        try:
            self._task = bar.add_task("train", total=self.total_steps, completed=self.start_step, status="")
            bar.start()
        except STREAM_ERRORS:
            self._broken = True
            return
        self._bar = bar

    def _write(self, line: str) -> None:
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except STREAM_ERRORS:
            self._broken = True


LONGEST_ETA_S = 999 * 86400  # an eta past it reads ">999 days"


def _describe(*, epoch: int, loss: float | None, samples_per_s: float | None, eta_s: float | None) -> str:
    """Return ``epoch 1  loss 2.3456  1,234 samples/s  eta 0:01:23``, leaving out the figures that are None."""
    parts = [f"epoch {epoch}"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if samples_per_s is not None:
        # whole numbers once they are large; a slow run (0.75 samples/s) still shows a figure
        rate = f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"
        parts.append(f"{rate} samples/s")
    if eta_s is not None:  # a --max-steps far past any run's length is shown so, not an overflow of timedelta
        shown = (
            f"{datetime.timedelta(seconds=round(eta_s))}"
            if eta_s < LONGEST_ETA_S
            else f">{LONGEST_ETA_S // 86400} days"
        )
        parts.append(f"eta {shown}")
    return "  ".join(parts)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except STREAM_ERRORS:
        return False
