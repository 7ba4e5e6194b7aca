"""torchrun's exit barrier, where each machine's launcher waits for the others' once its workers exited 0.

torch's waits inside its C++ store for up to 300 s, where no signal is acted on. A job that a signal stopped
on another machine meets no barrier there: that launcher ended on the signal, so this one waited out the 300 s,
then printed torch's traceback. Here the barrier is polled, so a signal is acted on within a poll, and a run a
signal stopped (the Trainer's stopped mark) waits ``STOPPED_BARRIER_S`` at most.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from redline.parallel.env import stopped_mark

log = logging.getLogger("redline")
STOPPED_BARRIER_S = 20.0  # long enough for the other machines' workers to end after the same agreed step
_POLL_S = 0.2


@contextlib.contextmanager
def polled_exit_barrier(finished: Path) -> Iterator[None]:
    """Within the block, torchrun's agents wait at their exit barrier as ``_exit_barrier`` does."""
    from torch.distributed.elastic.agent.server import api

    original = api.SimpleElasticAgent._exit_barrier

    def barrier(agent: Any) -> None:
        if not _private_names_here() or not all(
            hasattr(agent, name) for name in ("_store", "_worker_group", "_exit_barrier_timeout")
        ):
            original(agent)  # torch's private names changed (torch>=2.6 is supported): its own barrier
            return
        _exit_barrier(agent, finished)

    api.SimpleElasticAgent._exit_barrier = barrier  # type: ignore[method-assign]
    try:
        yield
    finally:
        api.SimpleElasticAgent._exit_barrier = original  # type: ignore[method-assign]


def _private_names_here() -> bool:
    """Whether this torch has the private names the polled barrier uses."""
    try:
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID  # noqa: F401
        from torch.distributed.elastic.utils.store import _barrier_nonblocking  # noqa: F401
    except ImportError:
        return False
    return True


def _exit_barrier(agent: Any, finished: Path) -> None:
    """Check in at the barrier's key (torch's ``_barrier_nonblocking``, as the other machines' torch does), then poll
    for the last one until the time allowed is out."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.utils.store import _barrier_nonblocking

    stopped = stopped_mark(finished).exists()
    limit = min(STOPPED_BARRIER_S, agent._exit_barrier_timeout) if stopped else agent._exit_barrier_timeout
    agent._in_exit_barrier = True  # torch's health check reads it
    try:
        last = _barrier_nonblocking(agent._store, agent._worker_group.group_world_size, _TERMINAL_STATE_SYNC_ID)
        end = time.monotonic() + limit
        while not agent._store.check([last]):
            if time.monotonic() > end:
                if not stopped:
                    log.warning(
                        "the other machines' launchers did not end within %g s of this one's workers: this one ends "
                        "without them", limit,
                    )  # fmt: skip
                return
            time.sleep(_POLL_S)  # torchrun's signal handler runs here: a SIGTERM ends the wait at once
    except SignalException:
        raise
    except Exception:  # the store's host (node rank 0's launcher) has ended: no one is left to wait for
        return
    finally:
        agent._in_exit_barrier = False
