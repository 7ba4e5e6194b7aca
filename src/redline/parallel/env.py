"""The distributed environment a worker runs in, as torchrun describes it, and its process group."""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import gc
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist

from redline.errors import ConfigError

HANG_TIMEOUT_ENV = "REDLINE_HANG_TIMEOUT"  # the launcher hands --hang-timeout to its workers through it
HANG_START_TIMEOUT_ENV = "REDLINE_HANG_START_TIMEOUT"  # and --hang-start-timeout
FINISHED_ENV = "REDLINE_FINISHED_FILE"  # where the workers tell the launcher that the run finished its work
# Longer than any hang watchdog timeout, so the watchdog's diagnosis comes before torch's own error.
COLLECTIVE_TIMEOUT = dt.timedelta(minutes=30)
_store: torch_dist.Store | None = None  # the store the process group met in, for the hang watchdog
_joins = 0  # process groups this process has joined: every rank joins and leaves in the same order


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Rank, world size and restart count of this worker; a single process is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    restart_count: int = 0
    launched: bool = False  # started by torchrun (even as 1 process): a process group can be formed
    hang_timeout_s: float = 0.0  # the launcher's --hang-timeout (REDLINE_HANG_TIMEOUT); 0: no hang watchdog
    hang_start_timeout_s: float = 0.0  # its --hang-start-timeout (REDLINE_HANG_START_TIMEOUT); 0: the default

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Whether this worker logs, shows progress and writes files (rank 0)."""
        return self.rank == 0


def is_launched(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is a launched worker's (torchrun, `redline launch`, a cluster's job): RANK and MASTER_ADDR
    are set. A RANK alone is no launcher's: it was left exported, or copied from another job."""
    return "RANK" in environ and "MASTER_ADDR" in environ


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...); none set means one process."""
    env = os.environ if environ is None else environ

    def number(name: str, default: int) -> int:
        text = env.get(name)
        if text is None or text == "":
            return default
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{name}={text!r} is not an integer\nhint: launch with `redline launch`") from None

    world = number("WORLD_SIZE", 1)
    rank = number("RANK", 0)
    if world > 1 and not env.get("RANK"):  # left over from another job: torch's rendezvous would fail on RANK
        raise ConfigError(
            f"WORLD_SIZE={world} is set in the environment without RANK, so this process is no rank of a launched "
            "run\nhint: unset WORLD_SIZE for one process, or start the processes with `redline launch` or "
            "`redline train --nproc N`"
        )
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world} are inconsistent\nhint: launch with `redline launch`")
    return DistEnv(
        rank=rank,
        world_size=world,
        local_rank=number("LOCAL_RANK", 0),
        local_world_size=number("LOCAL_WORLD_SIZE", 1),
        restart_count=number("TORCHELASTIC_RESTART_COUNT", 0),
        launched=is_launched(env),
        hang_timeout_s=_seconds(env, HANG_TIMEOUT_ENV),
        hang_start_timeout_s=_seconds(env, HANG_START_TIMEOUT_ENV),
    )


def _seconds(env: Mapping[str, str], name: str) -> float:
    """A timeout the launcher passes its workers (``--hang-timeout``); one left in the shell is read too."""
    text = env.get(name) or "0"
    flag = "--hang-start-timeout" if name == HANG_START_TIMEOUT_ENV else "--hang-timeout"
    hint = f"unset {name}, and give the launcher {flag} S for a timeout"
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of seconds\nhint: {hint}") from None
    if not value >= 0:
        raise ConfigError(f"{name}={text!r} must be >= 0 seconds\nhint: {hint}")
    return value


def check_hang_env(env: Mapping[str, str]) -> None:
    """Refuse a hang timeout left in ``env`` that no worker could read: said once, before the workers start."""
    for name in (HANG_TIMEOUT_ENV, HANG_START_TIMEOUT_ENV):
        _seconds(env, name)


def mark_finished(env: DistEnv, *, signalled: bool = False, received: bool = False) -> None:
    """Tell this machine's launcher how the Trainer's run ended: its work finished, so a signal that reaches the
    launcher now stops nothing; or, ``signalled``, a signal stopped it first (``stopped_mark``).

    Every rank calls it once the run has ended; the first worker of each machine writes the file the launcher
    named, or the stopped mark beside it (nothing without a launcher). A rank that ``received`` the signal itself
    (not only the other ranks' vote to stop) marks it too (``received_mark``).
    """
    path = os.environ.get(FINISHED_ENV)
    try:
        if path and signalled and received:
            received_mark(Path(path)).touch()
        if path and env.local_rank == 0:
            (stopped_mark(Path(path)) if signalled else Path(path)).touch()
    except OSError as error:  # the run's results are written; only the launcher's later reading of a signal is lost
        warnings.warn(
            f"could not mark the run's end for its launcher in {FINISHED_ENV}={path} ({error}); the run's results "
            f"are saved, but a signal reaching the launcher now may be reported as stopping the run\nhint: "
            f"{FINISHED_ENV} is redline launch's own variable to its workers: unset it where it was set by hand",
            stacklevel=2,
        )


def received_mark(finished: Path) -> Path:
    """Where a worker marks that the signal that stopped the run reached it: without it, on a machine of a job on
    several, the signal came to another machine (its launcher, Ctrl-C there) and this one's ranks stopped with it."""
    return finished.with_name(finished.name + ".received")


def stopped_mark(finished: Path) -> Path:
    """Where a worker's Trainer marks that a signal stopped its run before its work was done: one sent to the workers
    alone, which the launcher never saw; their exit 0 is then no finished run."""
    return finished.with_name(finished.name + ".stopped")


def interrupted_mark(finished: Path) -> Path:
    """Where a launcher marks that it passed a SIGINT on to its stopping workers (a second Ctrl-C), and where a worker
    it aborted once the run's steps were done writes ``FINISHING``: the launcher, not each worker, then says what the
    aborted run saved, once for the job."""
    return finished.with_name(finished.name + ".interrupted")


FINISHING = "finishing"  # the interrupted mark's text where the run's steps were done: it was writing its results


def launcher_interrupted(*, finishing: bool) -> bool:
    """Whether this worker's launcher passed it a SIGINT as it stopped (``interrupted_mark``); if so, tell it whether
    the run's steps were done (``finishing``)."""
    path = os.environ.get(FINISHED_ENV)
    mark = interrupted_mark(Path(path)) if path else None
    if mark is None or not mark.exists():
        return False
    if finishing:
        with contextlib.suppress(OSError):
            mark.write_text(FINISHING)
    return True


def backend_for(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_process_group(env: DistEnv, device_type: str) -> bool:
    """Join the process group torchrun set up (once); return whether this call created it."""
    if not (env.distributed or env.launched) or torch_dist.is_initialized():
        return False
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
    unmet = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if unmet:  # RANK and WORLD_SIZE left over from another job: torch's rendezvous would fail on the first of them
        raise ConfigError(
            f"RANK={env.rank} and WORLD_SIZE={env.world_size} are set in the environment without "
            f"{' and '.join(unmet)}, where the ranks meet, so this process is no rank of a launched run\nhint: unset "
            "RANK and WORLD_SIZE for one process, or start the processes with `redline launch` or "
            "`redline train --nproc N`"
        )
    backend = backend_for(device_type)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ:
        # A restarted worker (--max-restarts) meets the others in torchrun's long-lived store, where the
        # previous attempt's addresses still stand (seen with torch 2.13 and --standalone: the new
        # workers dialled the dead ones). A prefix per attempt keeps each attempt's keys apart.
        store = torch_dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size, is_master=False,
            timeout=COLLECTIVE_TIMEOUT,
        )  # fmt: skip
        # And a prefix per join: a second Runtime in the same process would otherwise read the first
        # group's keys, and its ranks dial ports that closed when the first group was left.
        global _store, _joins
        _joins += 1
        prefixed = torch_dist.PrefixStore(f"redline/attempt-{env.restart_count}/group-{_joins}", store)
        _store = prefixed
        torch_dist.init_process_group(
            backend=backend, store=prefixed, rank=env.rank, world_size=env.world_size, timeout=COLLECTIVE_TIMEOUT
        )
    else:
        torch_dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
    return True


def join_process_group(env: DistEnv, device_type: str) -> contextlib.ExitStack:
    """Join the launched job's process group, unless this process already has one; closing the stack leaves it.

    On gloo the group is also left at interpreter exit, for a script that never closes what joined
    it: an FSDP model freed after gloo's threads stopped could abort the interpreter's last clean-up.
    """
    stack = contextlib.ExitStack()
    if init_process_group(env, device_type):
        stack.callback(leave_process_group)
        if device_type == "cpu":
            atexit.register(leave_process_group)
            stack.callback(atexit.unregister, leave_process_group)
            # A group left while a model still held it (a DDP model in the script's frame, in cycles once that frame
            # is gone) lives on, its threads too, until the model is collected: collected at exit, it goes before the
            # interpreter's last clean-up, where gloo's threads ending aborted it (SIGABRT) now and then.
            atexit.unregister(gc.collect)
            atexit.register(gc.collect)
    return stack


def leave_process_group() -> None:
    """Leave the default process group (the one ``init_process_group`` joined), if any.

    Garbage is collected first: on gloo, an FSDP model freed by the interpreter's final collection,
    after gloo's threads lost the GIL, aborted the process in about 5% of CPU runs.
    """
    global _store
    _store = None  # the next group meets under its own prefix
    if torch_dist.is_initialized():
        gc.collect()
        torch_dist.destroy_process_group()


def process_group_store() -> torch_dist.Store | None:
    """Return the store the process group met in (None outside a distributed run)."""
    if _store is not None:
        return _store
    if not torch_dist.is_initialized():
        return None
    default = getattr(torch_dist.distributed_c10d, "_get_default_store", None)  # private; tolerated if absent
    try:
        return default() if default is not None else None
    except (RuntimeError, ValueError):
        return None
