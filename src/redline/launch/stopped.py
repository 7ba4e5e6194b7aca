"""How a launch that a signal stopped ends: the error its launcher exits with (``LaunchStopped``), saying what the
workers left and how to go on."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Literal

from redline.errors import RedlineError, StoppedBySignal
from redline.parallel.env import received_mark, stopped_mark

log = logging.getLogger("redline")

# What a second SIGINT to a launcher aborted: the run's stop, or, once its steps were done, the writing of its results
Aborted = Literal["stopping", "finishing"]
_SIGNAL_THE_LAUNCHER = "; to stop a launched job, signal the launcher (it passes the signal on to every worker)"


class LaunchError(RedlineError):
    """A worker of a launched job failed."""


class LaunchStopped(LaunchError, StoppedBySignal):
    """The launcher was sent SIGTERM/SIGINT (a scheduler preempting the job) and stopped its workers."""

    def __init__(
        self, signum: int, *, trainer: bool = True, workers_only: bool = False, newest: tuple[int, Path] | None = None,
        looked: bool = False, aborted: Aborted | None = None, elsewhere: bool = False, unsaved: bool = False,
    ) -> None:  # fmt: skip
        """``trainer``: the workers run ``redline train``; a script of the user's may take no --resume.
        ``workers_only``: a signal sent to the workers alone stopped the Trainer, not one to the launcher.
        ``looked``: the run's --out was looked in after the stop (``named``), and ``newest`` is the step and path of
        the newest checkpoint there, None where there is none. ``aborted``: what a second SIGINT aborted (``Aborted``),
        which `redline train` says in one process's words (cli/train.py's ``aborted``). ``elsewhere`` (with
        ``workers_only``): the signal reached no rank of this machine, but one on another machine of the job.
        ``unsaved``: `redline train` ran without --out, so nothing was saved to resume from (``unsaved()``)."""
        self.signum, self.trainer, self.workers_only, self.aborted = signum, trainer, workers_only, aborted
        self.elsewhere = elsewhere
        if aborted:
            super().__init__(signum, _aborted(trainer))
            return
        if elsewhere:
            said = (
                "stopped on another machine of the job: a signal reached a rank there (Ctrl-C or SIGTERM to its "
                "launcher, say), and this machine's ranks stopped with it, at the same step"
            )
        elif workers_only:
            said = (
                "stopped by a signal sent to the workers, not to the launcher: the Trainer's ranks stopped together "
                "before the run had finished its work"
            )
        else:
            said = f"stopped by {signal.Signals(signum).name}: the launcher passed it to every worker"
        other = _SIGNAL_THE_LAUNCHER if workers_only and not elsewhere else ""
        other += " (on every machine)" if elsewhere else ""
        if unsaved:  # as one process stopped so says it (cli/train.py's ``stopped_early``): --resume auto is refused
            message = (
                f"{said}; nothing was saved: the run has no --out\nhint: pass --out DIR to write checkpoints there "
                f"that the run can continue from (--resume auto){other}"
            )
        elif looked and newest is not None:
            message = (
                f"{said}; the newest checkpoint under --out is step {newest[0]}, at {newest[1]}\n"
                f"hint: run the same command again with --resume auto to continue from it{other}"
            )
        elif looked:
            message = (
                f"{said}; no checkpoint was written under --out (the workers were still setting up, or were stopped "
                f"before their first)\nhint: run the same command again to start over{other}"
            )
        elif workers_only and not trainer:
            message = (
                f"{said} and, with an out_dir, wrote a checkpoint there\nhint: run the same command again; with "
                f"resume='auto' in its TrainerConfig it continues from the last checkpoint{other}"
            )
        elif workers_only:
            message = (
                f"{said} and, with --out, wrote a checkpoint there\nhint: run the same command again with --resume "
                f"auto to continue from the last checkpoint{other}"
            )
        elif trainer:
            message = (
                f"{said}; the Trainer's ranks stop together after the step under way and, with --out, write a "
                "checkpoint there (within torchrun's 30 s grace; none where they were still setting up)\nhint: run "
                "the same command again with --resume auto to continue from the last checkpoint, or from the start "
                "if none"
            )
        else:
            message = (
                f"{said}; torchrun gives them 30 s to exit before it kills them\nhint: run the same command again to "
                "continue; a script that trains with redline's Trainer and an out_dir resumes from its last "
                "checkpoint with resume='auto'"
            )
        super().__init__(signum, message)

    def named(self, newest: tuple[int, Path] | None) -> LaunchStopped:
        """This stop of the Trainer's workers, naming the newest checkpoint they left under --out (``newest``: its
        step and path, the one --resume auto takes), or that they left none."""
        return LaunchStopped(
            self.signum, workers_only=self.workers_only, newest=newest, looked=True, elsewhere=self.elsewhere
        )

    def unsaved(self) -> LaunchStopped:
        """This stop of the Trainer's workers, run without --out: nothing was saved, and no --resume goes on."""
        return LaunchStopped(self.signum, workers_only=self.workers_only, unsaved=True, elsewhere=self.elsewhere)


def _aborted(trainer: bool) -> str:
    """The message of a launch a second SIGINT aborted where ``redline train`` does not name what was saved: the
    workers run a script of the user's, or this machine does not hold rank 0's --out."""
    if trainer:
        return (
            "aborted by a second SIGINT while the run was stopping: the launcher passed it to every worker, which "
            "ended without finishing the stop (its checkpoint may not be written)\nhint: run the same command again "
            "with --resume auto to continue from the last checkpoint under --out"
        )
    return (
        "aborted by a second SIGINT while the workers were stopping: the launcher passed it to every worker\nhint: "
        "run the same command again; a script that trains with redline's Trainer and an out_dir resumes from its last "
        "checkpoint with resume='auto'"
    )


def stopped_by(
    signum: int, finished: Path, *, trainer: bool = True, aborted: Aborted | None = None
) -> LaunchStopped | None:
    """Return the error a launcher sent ``signum`` exits with; None if the workers had finished their work by then.

    A signal that arrives as the run ends (while torchrun's agent waits at its exit barrier, say)
    stopped nothing: the workers marked the file ``finished`` (``mark_finished``), and the launch
    succeeded. Without the mark (they were stopped, or the script is not the Trainer's) it did stop them.
    ``trainer``: the workers run ``redline train``, whose resume the error names. ``aborted``: a second SIGINT
    came as they stopped, and was passed on to them (``Interrupts``): 130, as one process aborted so exits.
    """
    if not finished.exists():
        return LaunchStopped(signal.SIGINT if aborted else signum, trainer=trainer, aborted=aborted)
    log.info("%s arrived after the workers had finished their work: nothing to resume", signal.Signals(signum).name)
    return None


def unfinished(finished: Path, *, trainer: bool, several: bool = False) -> LaunchStopped | None:
    """Return the error of a launch whose Trainer's workers all exited 0 before the run finished its work.

    The Trainer stops on a signal that reaches any one rank (``kill`` of a worker's process, a scheduler that
    signals the workers and not the launcher): the ranks stop together, checkpoint and exit 0, so torchrun
    reports success. Without the workers' ``finished`` mark the run is not done, and the launch says so as a
    launcher sent the signal would: 143, and how to continue. ``trainer``: the workers run ``redline train``,
    which marks a finished run; a script of the user's is stopped where its Trainer left the stopped mark
    (``stopped_mark``). None for a finished run, or a script that ran no Trainer. ``several``: the job runs on
    several machines, where a run stopped without a signal reaching a rank here (``received_mark``) was stopped by
    one that reached another machine.
    """
    if finished.exists() or not (trainer or stopped_mark(finished).exists()):
        return None
    elsewhere = several and stopped_mark(finished).exists() and not received_mark(finished).exists()
    return LaunchStopped(signal.SIGTERM, trainer=trainer, workers_only=True, elsewhere=elsewhere)  # kill's 143
