"""The first program of each worker `redline launch` starts: it ties the worker to the launcher's life, then runs it.

torchrun starts every worker in a session of its own and nothing ends them when the launcher itself
is killed (SIGKILL from the out-of-memory killer, or a scheduler that kills the launcher's process
alone): they went on training without it, holding their GPUs and writing checkpoints into the --out
a rerun then resumed in, two jobs at once. Linux sends a process the signal it set with
``prctl(PR_SET_PDEATHSIG)`` when its parent dies, and keeps it across ``exec``: set here, it makes
the launcher's death a SIGTERM to the worker, which the Trainer meets as any SIGTERM (its ranks stop
together and write a checkpoint). Elsewhere the worker starts as before.

Run as a file, importing nothing of redline (not the package, which would import torch twice a
worker): ``python -u tethered.py LAUNCHER_PID [-m] TARGET [ARGS...]`` runs ``python -u [-m] TARGET [ARGS...]``
in its place (the same process, so torchrun sees its exit code).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(argv: list[str]) -> None:
    launcher, target = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before the line above: nothing would signal this one
            sys.exit(128 + signal.SIGTERM)
    os.execv(sys.executable, [sys.executable, "-u", *target])


if __name__ == "__main__":
    main(sys.argv[1:])
