"""Starting a script on N processes or N machines through torch.distributed.run (torchrun).

redline builds torchrun's arguments and calls its entry point in this process; rendezvous,
worker supervision and restarts are torchrun's own.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from argparse import Namespace
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from redline.config import non_negative_int, option, positive_int, positive_number
from redline.errors import PEER_STOPPED_MARK, SAID_ERRORS_ENV, ConfigError, first_line, invalid
from redline.launch import tethered
from redline.launch.barrier import polled_exit_barrier
from redline.launch.checks import check_master_addr, check_module, check_script
from redline.launch.interrupts import Interrupts
from redline.launch.stopped import LaunchError, LaunchStopped, stopped_by, unfinished
from redline.launch.waiting import not_joined, stoppable_while_waiting, waiting_note
from redline.parallel.env import FINISHED_ENV, HANG_START_TIMEOUT_ENV, HANG_TIMEOUT_ENV, check_hang_env

_ENDPOINT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d+$")
_MAX_PORT = 65535
DEFAULT_MASTER_PORT = 29500  # torchrun's own default for --master-port
log = logging.getLogger("redline")
JOIN_MARGIN_S = 30  # torchrun's rendezvous timeout past --join-timeout, at which the launcher ends itself first
TRAIN = ("redline", "train")  # the module and first argument of the workers `redline train --nproc` launches

if TYPE_CHECKING:  # torch's launcher is imported when a launch runs, not with this module
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How many workers, on how many machines, and how they meet."""

    nproc: int | str = option("auto", "Processes per machine: N or auto (every visible GPU, else 1).")
    nnodes: int = option(1, "Number of machines.", min=1)
    node_rank: int | None = option(None, "This machine's rank, 0..nnodes-1.")
    master_addr: str | None = option(None, "Address of the node-rank 0 machine.")
    master_port: int | None = option(
        None, f"A free port on the node-rank 0 machine ({DEFAULT_MASTER_PORT} with --master-addr on one machine)."
    )
    rdzv_endpoint: str | None = option(None, "HOST:PORT of a c10d rendezvous (instead of the three above).")
    join_timeout_s: int = option(
        900, "Seconds a machine of a job on several waits for the others to join.", flag="--join-timeout", min=1
    )
    max_restarts: int = option(0, "Restart failed workers up to K times (from the last checkpoint).", min=0)
    hang_timeout_s: float | None = option(
        None, "Seconds without progress before a hang report names the stalled rank.", flag="--hang-timeout"
    )
    hang_start_timeout_s: float | None = option(
        None,
        "Seconds allowed for the set-up and first step, with --hang-timeout (default: the larger of it and 600).",
        flag="--hang-start-timeout",
    )

    def __post_init__(self) -> None:
        if isinstance(self.nproc, str) and self.nproc.isdigit():  # from the command line
            object.__setattr__(self, "nproc", int(self.nproc))
        if self.nproc != "auto" and (not isinstance(self.nproc, int) or isinstance(self.nproc, bool) or self.nproc < 1):
            raise invalid(
                "nproc", self.nproc, "'auto' or a positive integer",
                "nproc=N starts N workers on this machine; nproc='auto' one per GPU (one in all without a GPU)",
            )  # fmt: skip
        positive_int("nnodes", self.nnodes)
        positive_int("join_timeout", self.join_timeout_s)
        non_negative_int("max_restarts", self.max_restarts)
        _check_hang_timeouts(self.hang_timeout_s, self.hang_start_timeout_s)
        if self.rdzv_endpoint is not None and not _ENDPOINT.match(self.rdzv_endpoint):
            raise invalid("rdzv_endpoint", self.rdzv_endpoint, "HOST:PORT", "e.g. --rdzv-endpoint 10.0.0.1:29400")
        if self.rdzv_endpoint is not None and int(self.rdzv_endpoint.rsplit(":", 1)[1]) > _MAX_PORT:
            raise invalid("rdzv_endpoint", self.rdzv_endpoint, f"HOST:PORT with PORT 0..{_MAX_PORT}")
        given = [f"--{n.replace('_', '-')}" for n in ("master_addr", "master_port") if getattr(self, n) is not None]
        if self.rdzv_endpoint is not None and given:  # else they were dropped: the workers met at the endpoint
            raise ConfigError(
                f"{', '.join(given)} and --rdzv-endpoint each say where the workers meet; pass one of them\n"
                f"hint: keep --rdzv-endpoint HOST:PORT (a c10d rendezvous), or drop it for {' and '.join(given)}"
            )
        if self.master_port is not None and not 0 <= self.master_port <= _MAX_PORT:
            raise invalid("master_port", self.master_port, f"a port number, 0..{_MAX_PORT}", "e.g. --master-port 29500")
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            missing = [n for n in ("node_rank", "master_addr", "master_port") if getattr(self, n) is None]
            if missing:
                raise ConfigError(
                    f"nnodes={self.nnodes} needs --{' --'.join(m.replace('_', '-') for m in missing)} "
                    "(or --rdzv-endpoint HOST:PORT)\nhint: run the same command on every machine, each with its "
                    "own --node-rank, all with the first machine's address as --master-addr"
                )
        if self.nnodes > 1:  # port 0 would have each machine take a free port of its own: none finds node 0's
            name, meeting, example = (
                ("master_port", self.master_port, "29500")
                if self.rdzv_endpoint is None
                else ("rdzv_endpoint", self.rdzv_endpoint, "HOST:29400")
            )
            if meeting is not None and int(str(meeting).rsplit(":", 1)[-1]) == 0:
                flag = "--" + name.replace("_", "-")
                raise invalid(
                    name, meeting, f"a fixed port (1..{_MAX_PORT}) for --nnodes {self.nnodes}",
                    "port 0 picks a free port on each machine, so the others cannot find the first one's: pass "
                    f"the same free port to every machine, e.g. {flag} {example}",
                )  # fmt: skip
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise invalid(
                "node_rank", self.node_rank, f"0..{self.nnodes - 1} for --nnodes {self.nnodes}",
                "number the machines from 0: node_rank=0 on the one whose address the others are given",
            )  # fmt: skip


def processes_per_node(nproc: int | str, cuda_count: int) -> tuple[int, str]:
    """Resolve ``--nproc auto``: every visible GPU, or one process on a CPU; return the count and why."""
    if nproc != "auto":
        return int(nproc), "requested"
    if cuda_count:
        return cuda_count, f"auto: one process per visible GPU ({cuda_count})"
    return 1, "auto: no GPU visible, one process"


def torchrun_args(config: LaunchConfig, nproc: int, target: Sequence[str], *, module: bool = False) -> list[str]:
    """Return torchrun's command-line arguments for ``target`` (a script and its arguments)."""
    if not target:
        raise ConfigError("nothing to launch\nhint: redline launch [OPTIONS] SCRIPT [ARGS...]")
    args = [f"--nproc-per-node={nproc}", f"--max-restarts={config.max_restarts}"]
    if config.rdzv_endpoint is not None:
        args += [f"--nnodes={config.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={config.rdzv_endpoint}",
                 "--rdzv-id=redline"]  # fmt: skip
        if config.nnodes == 1 and _this_machine(config.rdzv_endpoint.rsplit(":", 1)[0].strip("[]")):
            # No other machine will host the store: where this one cannot (the port is taken), torchrun would
            # wait as a client of whatever holds the port, silently, for its whole rendezvous timeout.
            args.append("--rdzv-conf=is_host=1")
        else:  # torch's timeout comes after the launcher's own (``waiting``), which says what to do in its place
            args.append(f"--rdzv-conf=join_timeout={config.join_timeout_s + JOIN_MARGIN_S}")
    elif config.nnodes > 1:
        args += [f"--nnodes={config.nnodes}", f"--node-rank={config.node_rank}",
                 f"--master-addr={config.master_addr}", f"--master-port={config.master_port}",
                 f"--rdzv-conf=timeout={config.join_timeout_s + JOIN_MARGIN_S}"]  # fmt: skip
    elif config.master_port == 0:  # one machine, any free port: torchrun's static rendezvous would hand its
        # workers MASTER_PORT=0, where they wait for the store until it times out; its c10d one takes a free port
        host = _master(config)[0]
        endpoint = f"[{host}]:0" if ":" in host else f"{host}:0"
        args += ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=redline",
                 "--rdzv-conf=is_host=1"]  # fmt: skip
    elif config.master_port is not None or config.master_addr is not None:  # one machine, meeting where asked
        host, port = _master(config)
        args += ["--nnodes=1", "--node-rank=0", f"--master-addr={host}", f"--master-port={port}"]
    else:
        args.append("--standalone")  # one machine: a local rendezvous on a free port
    if module:
        args.append("--module")
    return [*args, *target]


def _this_machine(host: str) -> bool:
    """Whether ``host`` names this machine (torch's own test, by which its c10d rendezvous hosts the store)."""
    from torch.distributed.elastic.rendezvous import utils

    matches = getattr(utils, "_matches_machine_hostname", None)  # private; tolerated if absent
    return bool(matches(host)) if matches is not None else host in ("localhost", "127.0.0.1", "::1")


def _master(config: LaunchConfig) -> tuple[str, int]:
    """The host and port of the rendezvous --master-addr and --master-port ask for, one given alone (one machine)."""
    port = DEFAULT_MASTER_PORT if config.master_port is None else config.master_port
    return config.master_addr or "127.0.0.1", port


def _check_hang_timeouts(timeout_s: float | None, start_timeout_s: float | None) -> None:
    positive_number("hang_timeout", timeout_s, optional=True)
    positive_number("hang_start_timeout", start_timeout_s, optional=True)
    if start_timeout_s is not None and timeout_s is None:
        raise invalid(
            "hang_start_timeout", start_timeout_s,
            "no value without hang_timeout=S: the start allowance is the hang watchdog's, which hang_timeout=S "
            "turns on", "add hang_timeout=S, the seconds any later step may take",
        )  # fmt: skip


def _hang_env(timeout_s: float, start_timeout_s: float | None) -> dict[str, str]:
    """What tells the workers the hang watchdog's timeouts."""
    given = {HANG_TIMEOUT_ENV: timeout_s, HANG_START_TIMEOUT_ENV: start_timeout_s}
    return {name: str(seconds) for name, seconds in given.items() if seconds is not None}


def _watchdog_env(config: LaunchConfig) -> dict[str, str]:
    """The hang watchdog's settings for the workers, from the launcher's flags; without them, the ones left in the
    shell are checked here, once, rather than refused by every worker after it started."""
    from redline.parallel.watchdog import enable_torch_debug

    if config.hang_timeout_s is None:
        check_hang_env(os.environ)
        return {}
    # torch's flight recorder, for the hang report
    return {**_hang_env(config.hang_timeout_s, config.hang_start_timeout_s), **enable_torch_debug(os.environ)}


def launch(config: LaunchConfig, target: Sequence[str], *, module: bool = False) -> None:
    """Run ``target`` on every worker through torchrun; raise LaunchError if the job fails."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import get_args_parser, run

    from redline.hardware.device import probe_accelerators, usable_cpu_count
    from redline.parallel.watchdog import HANG_EXIT_CODE

    if not module and target:
        check_script(Path(target[0]))
    elif target:
        check_module(target[0])
    check_master_addr(config)
    cuda_count, cores = probe_accelerators().cuda_count, usable_cpu_count()
    nproc, _ = processes_per_node(config.nproc, cuda_count)
    crowded = crowding(nproc, cores, cuda_count)
    if crowded is not None:
        log.warning("%s", crowded)
    workers = _watchdog_env(config)
    threads = worker_threads(nproc, cores, os.environ)
    if threads is not None:
        workers["OMP_NUM_THREADS"] = str(threads)
    argv = torchrun_args(config, nproc, target, module=module)
    # The script's own arguments are set, not parsed: argparse would take a --nproc or -m of theirs for torchrun's.
    args = get_args_parser().parse_args(argv[: len(argv) - len(target) + 1])
    args.training_script, args.training_script_args = target[0], list(target[1:])
    tether(args, os.getpid())
    stopped: LaunchStopped | None = None
    note = waiting_note(config)
    if note is not None:
        log.info("%s", note)
    with tempfile.TemporaryDirectory(prefix="redline-launch-") as scratch:
        others = f"the other machines of --nnodes {config.nnodes}"
        limit = (config.join_timeout_s, not_joined(config))
        waiting = (
            stoppable_while_waiting(others, lambda: shutil.rmtree(scratch), limit=limit)
            if note
            else contextlib.nullcontext()
        )
        finished = Path(scratch) / "finished"  # the workers' mark that the run finished its work
        workers[FINISHED_ENV] = str(finished)
        said = Path(scratch) / "said"  # where the workers mark the errors printed, to print each once
        said.mkdir()
        workers[SAID_ERRORS_ENV] = str(said)
        exit_barrier = polled_exit_barrier(finished)
        interrupts = Interrupts(finished)  # a second Ctrl-C goes on to the workers as SIGINT: they abort
        try:
            with worker_environment(workers), waiting, _launcher_unsaid(), interrupts.passing_on(), exit_barrier:
                run(args)
        except SignalException as exc:  # torchrun's agent has already sent the signal on and waited for the workers
            trainer = module and tuple(target[:2]) == TRAIN
            stopped = stopped_by(int(exc.sigval), finished, trainer=trainer, aborted=interrupts.aborted)
        except ChildFailedError as exc:
            printed = any(said.iterdir())  # a worker of redline's command line printed an error there
            done = finished.exists()
            peers = _peers_stopped(said, attempt=config.max_restarts) if config.nnodes > 1 else set()  # the last
            raise _failure(
                exc, HANG_EXIT_CODE, restarts=config.max_restarts, printed=printed, finished=done, peers=peers
            ) from None
        except (DistError, RendezvousError) as exc:  # the rendezvous could not listen, connect or gather the nodes
            raise _rendezvous_failure(config, exc) from None
        else:  # `redline train --help` exits 0 without training: nothing was stopped
            trainer = module and tuple(target[:2]) == TRAIN and "--help" not in target
            stopped = unfinished(finished, trainer=trainer, several=config.nnodes > 1)
    # Out of the except block the signal's traceback is gone, and with it torchrun's agent, which keeps its
    # rendezvous open on a signal. Collecting it stops the rendezvous' keep-alive thread, which would
    # otherwise run into the interpreter's exit inside a store call and abort the launcher (SIGABRT,
    # "terminate called without an active exception") instead of letting it exit as the signal asks.
    gc.collect()
    if stopped is not None:
        raise stopped


@contextlib.contextmanager
def _launcher_unsaid() -> Iterator[None]:
    """Quiet torchrun's agent's warnings while it runs ("Sending process ... closing signal SIGTERM", "Received 15
    death signal, shutting down workers"): the stop they narrate is said after it, by rank and cause. Its errors
    stay: "failed (exitcode: -9) local_rank: 1" is the one word of a worker that a restart (--max-restarts) hid."""
    # torch's get_logger gives each of its modules' loggers a level of its own (WARNING), which the parent's cannot
    # raise: each is set, the agent's ("torch.distributed.elastic.agent.server.api") among them.
    names = ["torch.distributed.elastic", *(n for n in logging.root.manager.loggerDict if n.startswith(_ELASTIC))]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)  # setLevel, not the attribute: it clears the loggers' cached levels
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


_ELASTIC = "torch.distributed.elastic."


def tether(args: Namespace, launcher: int) -> None:
    """Start each worker through ``tethered.py``, so that the launcher's death (SIGKILL) ends it (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    module = ["-m"] if args.module else []
    args.training_script_args = [str(launcher), *module, args.training_script, *args.training_script_args]
    args.training_script, args.module = tethered.__file__, False


def crowding(nproc: int, cores: int, cuda_count: int) -> str | None:
    """The warning for more CPU workers than this machine has cores to run them on (None where they fit, or on GPUs).

    Each worker then gets part of a core, every step waits for the slowest at the gradients' all-reduce,
    and each holds its own torch, model and data in memory: the job runs slower than on fewer workers.
    """
    if cuda_count or nproc <= cores:
        return None
    return (
        f"--nproc {nproc} starts {nproc} workers on the {cores} core{'s' if cores > 1 else ''} here, with no GPU "
        "visible: they take turns on the cores, each step waits for the slowest, and each worker holds its own copy "
        f"of torch, the model and the data in memory, so the job runs slower than on {cores}\nhint: pass --nproc "
        f"{cores} or fewer"
    )


def worker_threads(nproc: int, cores: int, environ: Mapping[str, str]) -> int | None:
    """The CPU threads each worker runs: the cores shared among the workers, where OMP_NUM_THREADS leaves it to us.

    torchrun's default is one thread a worker, which leaves most of a machine's cores idle in CPU
    training and in a GPU worker's CPU-side work. None where the user set OMP_NUM_THREADS, or for one worker.
    """
    if nproc <= 1 or "OMP_NUM_THREADS" in environ:
        return None
    threads = max(1, cores // nproc)
    log.info(
        "each of the %d workers runs %d CPU thread%s (the %d cores here, shared; OMP_NUM_THREADS chooses another)",
        nproc, threads, "" if threads == 1 else "s", cores,
    )  # fmt: skip
    return threads


def _rendezvous_failure(config: LaunchConfig, exc: Exception) -> LaunchError:
    """The error of a rendezvous that could not be set up: the address, torch's reason and the fix."""
    inner: BaseException = exc
    while inner.__cause__ is not None:  # the c10d rendezvous says "see inner exception for details"
        inner = inner.__cause__
    reason = first_line(inner) or type(inner).__name__
    if config.rdzv_endpoint is not None:
        where, flag = config.rdzv_endpoint, "--rdzv-endpoint"
    elif config.nnodes == 1 and config.master_port is None and config.master_addr is None:
        where, flag = "this machine (a free port)", "--master-port"
    else:
        where, flag = "{}:{}".format(*_master(config)), "--master-port"
    if "EADDRINUSE" in reason or "address already in use" in reason:
        hint = f"another process holds that port: pass a free one to {flag}"
        if config.nnodes == 1 and config.rdzv_endpoint is None:
            hint += " (or leave --master-port and --master-addr out: one machine then meets on a free port)"
    else:
        hint = f"check that the node-rank 0 machine is up and that {where} is reachable from here"
    return LaunchError(f"the workers' rendezvous at {where} could not be set up: {reason}\nhint: {hint}")


def _peers_stopped(said: Path, *, attempt: int) -> set[int]:
    """The ranks of this machine whose error in ``attempt`` said another rank stopped first (``mark_peer_stopped``).
    torchrun gives up after its last attempt, --max-restarts: the exit codes it reports are that attempt's."""
    marks = (path.name.removeprefix(f"{PEER_STOPPED_MARK}{attempt}-") for path in said.glob(f"{PEER_STOPPED_MARK}*"))
    return {int(rank) for rank in marks if rank.isdigit()}


def _failure(
    exc: ChildFailedError, hang_exit_code: int, *, restarts: int = 0, printed: bool = False, finished: bool = False,
    peers: Collection[int] = (),
) -> LaunchError:  # fmt: skip
    """The error of a job whose workers failed: the hang watchdog's diagnosis, or each failed rank's exit code.

    torchrun gives up only once ``restarts`` (--max-restarts) are used up: every attempt failed, and the
    ranks named are the last attempt's. ``printed``: a worker marked an error it printed (``first_to_say``);
    else the hint says what the first failed rank's exit code or signal tells, and points at no error above.
    ``finished``: the workers' Trainer had marked its work finished (``mark_finished``) before they failed.
    ``peers``: the ranks (of a job on several machines) whose error said another rank stopped first: where every
    rank of this machine that failed is one of them, the cause is on another machine, and the error says so.
    """
    hangs = [f.message for f in exc.failures.values() if f.exitcode == hang_exit_code and f.message]
    if hangs:  # the watchdog's diagnosis, once
        message = hangs[0].get("message", hangs[0]) if isinstance(hangs[0], dict) else hangs[0]
        said = str(message).removeprefix("HangError: ")  # torchelastic's error file prefixes the type
        return _with_exit_code(LaunchError(said), hang_exit_code)
    codes = sorted((rank, failure.exitcode) for rank, failure in exc.failures.items())
    if peers and all(rank in peers or code in _STOPPED for rank, code in codes) and not finished:
        return _with_exit_code(_stopped_elsewhere(codes, peers, restarts), next(c for r, c in codes if r in peers))
    stopped = [rank for rank, code in codes if code in _STOPPED]
    own = [(rank, code) for rank, code in codes if code not in _STOPPED]
    if own and stopped:  # the launcher ends the other workers once one fails: they did not fail themselves
        failures = "; ".join(f"rank {rank} {_ended(code)}" for rank, code in own)
        failures += f" (then the launcher stopped rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))})"
    else:
        failures = "; ".join(f"rank {rank} {_ended(code)}" for rank, code in codes)
    first = min(exc.failures.items(), key=lambda item: (item[1].exitcode in _STOPPED, item[1].timestamp, item[0]))
    attempts = f" in all {restarts + 1} attempts (--max-restarts {restarts} used up); in the last" if restarts else ""
    hint = "the workers' errors are printed above, each once" if printed else _unsaid(first[0], first[1].exitcode)
    if finished:  # what failed came after fit(): the results a scheduler would rerun the job for are there
        failures += (
            ", after the Trainer had finished its work (with --out, its last checkpoint, final weights and summary "
            "are written)"
        )
    error = LaunchError(f"the launched job failed{attempts}: {failures}\nhint: {hint}")
    return _with_exit_code(error, first[1].exitcode)


def _stopped_elsewhere(codes: Sequence[tuple[int, int]], peers: Collection[int], restarts: int) -> LaunchError:
    """The error of a machine whose ranks stopped because a rank on another machine stopped first."""
    ranks = [rank for rank, _ in codes if rank in peers]
    which = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    attempts = f" in all {restarts + 1} attempts (--max-restarts {restarts} used up)" if restarts else ""
    return LaunchError(
        f"the launched job stopped{attempts} because a rank on another machine failed: this machine's {which} "
        "only saw a collective with it break\nhint: the other machine's output says why (its launcher names the "
        "rank that failed); fix that, then start the same command on every machine again"
    )


_CRASHES = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)


def _unsaid(rank: int, code: int) -> str:
    """The hint for a rank that failed without an error redline saw it print: what its exit code or signal says."""
    if code == -signal.SIGKILL:
        return (
            f"SIGKILL gives rank {rank} no chance to print anything: if the kernel's log (`dmesg`) names the "
            "out-of-memory killer, give each worker less host memory (a smaller batch, fewer --nproc, fewer loader "
            "workers)"
        )
    if -code in _CRASHES:
        return (
            f"rank {rank} crashed in native code (torch, a C extension, a driver), which prints no Python error: "
            "run again with PYTHONFAULTHANDLER=1 in the environment for each worker's Python stack as it crashes"
        )
    if code < 0:
        return f"the signal came from outside rank {rank} (a scheduler, the system, a kill), which prints no error"
    if code == 1:
        return (
            "exit code 1 is Python's after an exception reached the top of the script (its traceback, printed by "
            f"rank {rank}, comes before the launcher's lines), or the script's own sys.exit(1), which prints nothing"
        )
    return (
        f"no error of redline's was printed: rank {rank}'s exit code {code} is the script's own (sys.exit({code}) "
        f"or os._exit({code})): look in it for where it exits so"
    )


def _with_exit_code(error: LaunchError, code: int) -> LaunchError:
    """``error``, exiting as the worker that failed first did: its exit code, or 128 + the signal that ended it.

    A scheduler reads the job's status as the worker's: 1 for an exception, 2 for a mistake redline
    named, 124 for a hang, 137 for SIGKILL (the out-of-memory killer), as a shell reports a signal.
    """
    error.exit_code = 128 - code if code < 0 else code if 0 < code < 256 else 1
    return error


_STOPPED = (-signal.SIGTERM,)  # how a worker the launcher ended exits (SIGKILL may be the kernel's)


def _ended(code: int) -> str:
    """How a worker ended: its exit code, or the signal that ended it (a negative code)."""
    if code == -signal.SIGKILL:
        return (
            "was ended by SIGKILL (the kernel's out-of-memory killer sends it, or the launcher to a worker "
            "that outlived its SIGTERM)"
        )
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was ended by {signal.Signals(-code).name}"
    return f"exited with {code}"


@contextlib.contextmanager
def worker_environment(variables: Mapping[str, str]) -> Iterator[None]:
    """Give the workers ``variables``: torchrun starts them with this process's environment, put back after."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
