"""Ctrl-C and SIGTERM stop a launcher that waits for the other machines of its job.

torchrun's rendezvous waits for every machine inside torch's C++ store (up to its timeout, minutes),
where Python's signal handlers do not run until the wait ends: Ctrl-C did nothing. Python's C-level
handler still writes the signal's number to the wakeup fd the moment it arrives (``signal.set_wakeup_fd``),
so a thread reading that fd sees it at once. While no worker has started (torchrun installs its own
SIGINT and SIGTERM handlers when it starts them, and from then on passes a signal on to them), nothing is lost by
ending the launcher there, and the thread does, exiting as the signal asks (128 + its number).

The same guard ends a launcher whose job's other machines did not join within --join-timeout, in redline's words,
before torch's own timeout (a C++ error and stack on a machine that waits for node rank 0, then retries for ever).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redline.launch.torchrun import LaunchConfig

log = logging.getLogger("redline")
_STOPPING = (signal.SIGINT, signal.SIGTERM)
JOIN_EXIT_CODE = 2  # a job whose machines did not all join: the command line's exit for a mistake it named


@contextlib.contextmanager
def stoppable_while_waiting(
    what: str, cleanup: Callable[[], None] = lambda: None, *, limit: tuple[float, str] | None = None
) -> Iterator[None]:
    """Within the block, let SIGINT or SIGTERM end the process while no worker has started; ``what`` is waited for.

    Call it from the main thread. ``cleanup`` runs before the process ends (it exits without unwinding).
    ``limit``: the seconds to wait for the workers to start, and the error said on ending the process after them.
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets the wakeup fd
        yield
        return
    # Python's default for SIGTERM kills at once, past the wakeup fd, which only a handler of Python's is written
    # to: one that does nothing lets the thread below see it
    defaults = [signum for signum in _STOPPING if signal.getsignal(signum) is signal.SIG_DFL]
    for signum in defaults:
        signal.signal(signum, _seen)
    before = {signum: signal.getsignal(signum) for signum in _STOPPING}  # torchrun replaces them as workers start
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # as set_wakeup_fd requires
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def waiting() -> bool:  # torchrun replaces the handlers as it starts the workers
        return all(signal.getsignal(s) is handler for s, handler in before.items())

    def watch() -> None:
        while data := _receive(reader):
            for signum in data:
                if signum in _STOPPING and waiting():
                    _end(signal.Signals(signum), what, cleanup)

    thread = threading.Thread(target=watch, name="redline-launch-waiting", daemon=True)
    thread.start()
    timer = threading.Timer(limit[0], lambda: waiting() and _give_up(limit[1], cleanup)) if limit else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        signal.set_wakeup_fd(previous)
        writer.close()  # the thread's read returns empty: it ends
        thread.join(timeout=5)
        reader.close()
        for signum in defaults:
            if signal.getsignal(signum) is _seen:  # not once torchrun has put its own in place
                signal.signal(signum, signal.SIG_DFL)


def _seen(signum: int, frame: FrameType | None) -> None:
    """A handler that leaves a stopping signal to the thread reading the wakeup fd."""


def _receive(reader: socket.socket) -> bytes:
    try:
        return reader.recv(64)
    except OSError:  # closed under it: the block is over
        return b""


def _end(signum: signal.Signals, what: str, cleanup: Callable[[], None]) -> None:
    log.error(
        "stopped by %s while waiting for %s: no worker had started, so nothing is lost\n"
        "hint: start the same command on every machine of the job, then run this one again",
        signum.name, what,
    )  # fmt: skip
    with contextlib.suppress(Exception):
        cleanup()
    logging.shutdown()  # flush what was said: the process ends without unwinding
    os._exit(128 + signum)


def _give_up(message: str, cleanup: Callable[[], None]) -> bool:
    """End the process with ``message``: the others did not join in time, and no worker had started."""
    log.error("%s", message)
    with contextlib.suppress(Exception):
        cleanup()
    logging.shutdown()
    os._exit(JOIN_EXIT_CODE)


def _not_joined(who: str, others: str, where: str, seconds: float, node_rank: int | None) -> str:
    """The error of a machine (``who``) whose job's ``others`` did not all join at ``where`` within ``seconds``."""
    if node_rank == 0:
        listening = f"this machine listened at {where}, and not all of them connected"
        check = f"that {where} is reachable from them (a firewall, the address they were given)"
    elif node_rank is not None:
        listening = f"node rank 0 listens at {where}: it was not up, or not all of them joined"
        check = f"that node rank 0 runs and that {where} is reachable from here"
    else:
        listening = f"the rendezvous at {where} did not see all of them"
        check = f"that {where} is reachable from every machine"
    return (
        f"{who} waited {seconds:g} s (--join-timeout) for {others}, which did not join: {listening}; no worker had "
        "started, so nothing is lost\nhint: start the same command on every machine, each with its own --node-rank "
        f"and all with the same --nnodes, --master-addr and --master-port (or --rdzv-endpoint); check {check}; "
        "--join-timeout SECONDS gives them longer"
    )


def waiting_note(config: LaunchConfig) -> str | None:
    """What a machine of a job on several waits for before its workers start, said before torchrun waits silently
    (up to its rendezvous timeout, minutes)."""
    if config.nnodes == 1:
        return None
    where, who, others = _meeting(config)
    each = " with its own --node-rank" if config.node_rank is not None else ""
    return (
        f"{who} waits for {others} of --nnodes {config.nnodes} at {where}, up to {config.join_timeout_s} s "
        f"(--join-timeout): run the same command on each{each}"
    )


def _meeting(config: LaunchConfig) -> tuple[str, str, str]:
    """Where a job on several machines meets, this machine and the others, in words."""
    where = config.rdzv_endpoint or f"{config.master_addr}:{config.master_port}"
    who = "this machine" if config.node_rank is None else f"this machine (node rank {config.node_rank})"
    others = "the other machine" if config.nnodes == 2 else f"the other {config.nnodes - 1} machines"
    return where, who, others


def not_joined(config: LaunchConfig) -> str:
    """The error of a machine whose job's other machines did not join within --join-timeout."""
    where, who, others = _meeting(config)
    return _not_joined(who, f"{others} of --nnodes {config.nnodes}", where, config.join_timeout_s, config.node_rank)
