"""The hang watchdog: when training stops progressing, every rank writes its stack and the job fails with one diagnosis.

A collective that never completes (a rank stuck in its data loader, a rank that skipped a step, a dead
link) otherwise blocks every rank until the backend's own timeout, which then names no culprit. The
training loop calls ``Watchdog.beat(step, where)`` at cheap points. A thread on each rank fires when its
own rank has not beaten for ``timeout_s`` (every rank blocked in the stalled collective does, so no
clocks are compared across hosts) or when another rank has fired. Until the rank's first step is done
(its beats name a later step than the first they named), the limit is ``start_timeout_s`` instead: the
set-up (building, wrapping, loading a checkpoint) and the first step (a first compile takes minutes on a
large model) are slower than any later step, and a limit tight enough for the steps would end the job
there; by default it is the larger of ``timeout_s`` and ten minutes, as torchtitan's init timeout
allows more than its train timeout. Firing:

1. writes this rank's Python stacks and the collective it is in, read from torch's flight recorder, to
   ``out_dir/hang-rank{rank}.txt``, and the recorder's raw dump to ``out_dir/flight_recorder/rank_{rank}``
   for torch's analyzer, ``torchfrtrace out_dir/flight_recorder`` (it reads NCCL's dumps; torch 2.13's
   gloo dumps lack the table of groups it needs);
2. the first rank to fire gathers every rank's position from the store and names the rank(s) behind the
   others (``diagnose``) in ``out_dir/hang.txt``, on stderr, and in torchelastic's error file, so torchrun's
   failure summary (and ``ChildFailedError.failures[rank].message``) carries the diagnosis;
3. every rank exits with HANG_EXIT_CODE, the only way out of a blocked collective; torchrun stops the rest.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import torch
import torch.distributed as torch_dist
from torch.torch_version import TorchVersion

from redline.config import positive_number
from redline.errors import SAID_ERRORS_ENV, RedlineError, few, invalid

HANG_EXIT_CODE = 124  # as coreutils timeout(1) uses; torchrun reports it as the worker's exitcode
REPORT_FILE = "hang.txt"
FR_DIR = "flight_recorder"
_GATHER_S = 5.0  # how long the first rank to fire waits for the others' stacks
_STORE_TIMEOUT_S = 10.0  # the longest any store call of the watchdog blocks
_DEADLINE_S = _GATHER_S + 3 * _STORE_TIMEOUT_S  # a firing rank exits by then, whatever the store or disk do
START_ALLOWANCE_S = 600.0  # the least a rank's set-up and first step are allowed, unless start_timeout_s is given

log = logging.getLogger("redline")


class HangError(RedlineError, RuntimeError):
    """The job stopped progressing for longer than the hang timeout."""


@dataclass(frozen=True)
class Position:
    """Where one rank stands: what it publishes to the store and what ``diagnose`` reads."""

    step: int  # -1 before the first beat
    where: str
    beats: int  # beats within this step: orders ranks at the same step
    time: float  # wall clock (time.time()) of the last beat, on that rank's host
    collectives: int | None = None  # collectives entered so far (flight recorder); None when unknown
    collective: str | None = None  # the collective it waits in, or the last one it completed
    stack: str | None = None  # where its stack went, once written


@dataclass(frozen=True)
class Hang:
    """A diagnosed hang: the ranks behind the others and the message that says so."""

    stalled: tuple[int, ...]
    message: str


def diagnose(
    records: Mapping[int, Position], *, now: float, timeout_s: float, world_size: int, starting: bool = False
) -> Hang | None:
    """Return the hang the records show (some rank without a beat for over ``timeout_s``), else None.

    The stalled ranks are those without a record, else those with the least progress by (step,
    collectives entered, beats within the step): clocks never decide who stalled. Ages, clamped at 0
    because hosts' clocks differ, only decide whether there is a hang, and are reported. ``starting``:
    ``timeout_s`` is the start allowance (the set-up and first step), and the report says so.
    """
    if not any(now - p.time > timeout_s for p in records.values()):
        return None
    return _describe(records, now=now, timeout_s=timeout_s, world_size=world_size, starting=starting)


def _behind(records: Mapping[int, Position], world_size: int) -> list[int]:
    missing = [r for r in range(world_size) if r not in records]
    if missing or not records:
        return missing
    known = all(p.collectives is not None for p in records.values())
    progress = {r: (p.step, (p.collectives or 0) if known else 0, p.beats) for r, p in records.items()}
    least = min(progress.values())
    return sorted(r for r, key in progress.items() if key == least)


def _describe(
    records: Mapping[int, Position], *, now: float, timeout_s: float, world_size: int, starting: bool = False
) -> Hang:
    stalled = _behind(records, world_size)
    waiting = sorted(r for r in records if r not in stalled)
    first = records.get(stalled[0])
    if first is None:
        head = f"{_ranks(stalled)} never started a watchdog, and the others wait for it"
        hint = "that rank is stuck before its training loop (import, data, init_process_group): see its output"
    elif waiting or world_size == 1:
        at = f"at step {first.step} in {first.where!r}" if first.step >= 0 else "before its first beat"
        head = f"{_ranks(stalled)} stopped {at}" + (", and the others wait for it" if waiting else "")
        slower = "(building, loading, a first compile)" if starting else "(a checkpoint, evaluation on one rank)"
        hint = (
            f"the stack of {_ranks(stalled)} shows where it is stuck; if that work is legitimately slower "
            f"{slower}, raise --hang-{'start-' * starting}timeout"
        )
    else:
        head = f"all {world_size} ranks stopped at step {first.step} in {first.where!r}, none behind the others"
        hint = (
            "the collective itself does not complete: check the links between hosts (NCCL_DEBUG=INFO) and that "
            "every rank issues the same collectives with the same shapes (TORCH_DISTRIBUTED_DEBUG=DETAIL)"
        )
    if mismatch := _mismatched_collective(records):
        head = f"collective mismatch: {mismatch}"
        hint = (
            "a collective called on some ranks only (e.g. rt.save under `if rank == 0`: every rank must call it), "
            "or in another order, or ranks that ran different numbers of steps (a loop over data of another length "
            "on each rank: rt.setup_loader gives each rank an equal share of one dataset, not of each rank's own): "
            "every rank must issue the same collectives; no --hang-timeout ends this wait"
        )
    limit = f"hang start timeout {timeout_s:g} s, for the set-up and first step" if starting else None
    lines = [f"hang: {head} ({limit or f'hang timeout {timeout_s:g} s'})"]
    for role, ranks in (("stalled", stalled), ("waiting", waiting)):
        groups: dict[tuple[int, str, str | None], list[int]] = {}
        for r in (r for r in ranks if r in records):
            groups.setdefault((records[r].step, records[r].where, records[r].collective), []).append(r)
        for (step, where, collective), group in groups.items():
            age = min(max(0.0, now - records[r].time) for r in group)
            lines.append(
                f"  {role} {_ranks(group)}: step {step}, {where!r}, last beat {age:.1f} s ago; "
                f"collective: {collective or 'unknown'}"
            )
    stacks = [p.stack for r in [*stalled, *waiting] if (p := records.get(r)) and p.stack]
    if stacks:
        lines.append("  stacks: " + few(stacks, 8))
    if silent := [r for r in range(world_size) if r not in records or not records[r].stack]:
        lines.append(f"  no stack from {_ranks(silent)}: dead, stopped, out of its loop, or holding the GIL")
    if any(p.collectives is None for p in records.values()):
        hint += "; to see collectives, turn on torch's flight recorder (TORCH_FR_BUFFER_SIZE=2000)"
    return Hang(stalled=tuple(stalled), message="\n".join([*lines, f"hint: {hint}"]))


def _mismatched_collective(records: Mapping[int, Position]) -> str | None:
    """Name the ranks that wait in the same collective (by its sequence number) with different operations or shapes,
    the mark of a collective some ranks never call; None where they agree or the collectives are unknown."""
    by_number: dict[str, dict[str, list[int]]] = {}
    for rank, position in sorted(records.items()):
        number, _, what = (position.collective or "").removeprefix("in ").partition(" ")
        if position.collective and position.collective.startswith("in #") and what:
            by_number.setdefault(number, {}).setdefault(what, []).append(rank)
    for number, calls in by_number.items():
        if len(calls) > 1:
            each = ", ".join(f"{_ranks(ranks)} in {what}" for what, ranks in calls.items())
            return f"the ranks wait in collective {number} with different operations: {each}"
    return None


def _ranks(ranks: Sequence[int]) -> str:
    """Name ranks compactly: 'rank 3', 'ranks 0-2, 5'."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def enable_torch_debug(
    env: Mapping[str, str], out_dir: Path | None = None, *, torch_version: str = torch.__version__
) -> dict[str, str]:
    """Return the variables that turn on torch's flight recorder, for the launcher to give the workers.

    A setting already in ``env``, under either of its names, is left alone: the user's choice wins.
    Source: PyTorch, "Flight Recorder for Debugging Stuck Jobs"
    (pytorch.org/tutorials/prototype/flight_recorder_tutorial.html), which recommends 2000 entries.
    Torch 2.8 renamed TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE to TORCH_FR_*
    (gloo reads those too; the old names warn) (github.com/NVIDIA/nvidia-resiliency-ext/pull/163).
    TORCH_NCCL_DUMP_ON_TIMEOUT makes NCCL dump when its own, longer, timeout fires.
    """
    new = TorchVersion(torch_version) >= "2.8"
    settings = [
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
    ]
    if out_dir is not None:  # the rank is appended to the prefix
        settings.append(("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(out_dir / FR_DIR / "rank_")))
    return {(name if new else old): value for name, old, value in settings if name not in env and old not in env}


class _Beat(NamedTuple):
    step: int
    where: str
    beats: int
    mono: float  # time.monotonic(): immune to clock adjustments


class Watchdog:
    """Watch this rank's progress; on a hang, dump every rank's stack, report once, and exit the process.

    ``store`` is the job's store (the one init_process_group used); the watchdog clones it, so a main
    thread blocked in the store cannot block the watchdog. Beat before each phase a rank may wait in.
    """

    def __init__(
        self,
        store: torch_dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float,
        out_dir: Path | None = None,
        *,
        start_timeout_s: float | None = None,
    ) -> None:
        positive_number("hang_timeout", timeout_s)
        positive_number("hang_start_timeout", start_timeout_s, optional=True)
        if not 0 <= rank < world_size:
            raise invalid("rank", rank, f"0..{world_size - 1} for world_size={world_size}")
        try:
            store = getattr(store, "clone")()  # noqa: B009 (torch's stubs lack Store.clone)
            store.set_timeout(dt.timedelta(seconds=_STORE_TIMEOUT_S))
        except (AttributeError, RuntimeError):
            pass  # a store that cannot be cloned is used as given
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.out_dir = timeout_s, out_dir
        self.start_timeout_s = max(timeout_s, START_ALLOWANCE_S) if start_timeout_s is None else start_timeout_s
        self.poll_s = min(1.0, timeout_s / 4, self.start_timeout_s / 4)
        self._first_step: int | None = None  # the step the first beat named: the start lasts until a later one
        # torchrun keeps its store across restarts: a new attempt must not read the last one's hang
        self._key = f"redline/watchdog/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._last = _Beat(-1, "start", 0, time.monotonic())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redline-hang-watchdog", daemon=True)
        self._exit: Callable[[int], Any] = os._exit  # the tests replace it

    def beat(self, step: int, where: str) -> None:
        """Record that this rank reached ``where`` in ``step``: one tuple, no I/O, well under a microsecond."""
        last = self._last
        self._last = _Beat(step, where, last.beats + 1 if step == last.step else 1, time.monotonic())
        if self._first_step is None:
            self._first_step = step

    def __enter__(self) -> Watchdog:
        self._publish(self._position(self._last))
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.beat(self._last.step, "left the watched loop")  # ranks that still wait will name this one
        self._publish(self._position(self._last))

    def _run(self) -> None:
        published = self._last
        while not self._stop.wait(self.poll_s):
            beat = self._last
            if beat is not published:  # the store sees progress at most once a poll, off the training thread
                self._publish(self._position(beat))
                published = beat
            if time.monotonic() - beat.mono > self._limit(beat)[0] or self._store_call(
                self.store.check, [self._key + "hang"]
            ):
                self._fire(beat)
                return

    def _limit(self, beat: _Beat) -> tuple[float, bool]:
        """The seconds ``beat`` may stay the last, and whether the start allowance applies (no step done yet)."""
        first = self._first_step
        starting = first is None or beat.step <= first
        return (self.start_timeout_s if starting else self.timeout_s), starting

    def _fire(self, beat: _Beat) -> None:
        deadline = threading.Timer(_DEADLINE_S, self._exit, args=(HANG_EXIT_CODE,))
        deadline.name, deadline.daemon = f"{self._thread.name}-deadline", True
        deadline.start()
        entries = _flight_recorder(self.out_dir / FR_DIR / f"rank_{self.rank}" if self.out_dir else None)
        position = self._position(beat, entries)
        position = dataclasses.replace(position, stack=self._write_stack(position, entries))
        first = self._store_call(self.store.add, self._key + "hang", 1) in (1, None)  # None: no store, report alone
        self._publish(position)
        where = (self.rank, position.stack)
        if first:
            message = self._describe_all(position, *self._limit(beat))
            if self.out_dir is not None:
                _write(self.out_dir / REPORT_FILE, message + "\n")
            if _launcher_says():
                log.error("redline hang watchdog, rank %d: stack in %s; the launcher prints the diagnosis", *where)
            else:
                log.error("%s", message)
            self._store_call(self.store.set, self._key + "report", message)
        else:  # stay until the report exists: exiting first would let torchrun kill the reporting rank
            self._store_call(self.store.wait, [self._key + "report"], dt.timedelta(seconds=_GATHER_S + 2))
            report = self._store_call(self.store.get, self._key + "report") if self._reported() else None
            message = report.decode() if isinstance(report, bytes) else self._describe_all(position, *self._limit(beat))
            log.error("redline hang watchdog, rank %d: stack in %s", *where)
        _record_for_torchrun(message)
        deadline.cancel()
        self._exit(HANG_EXIT_CODE)

    def _describe_all(self, mine: Position, limit_s: float, starting: bool) -> str:
        """Wait (bounded) for every rank's stack, then describe the hang from all positions."""
        end = time.monotonic() + _GATHER_S
        while True:
            records = {r: p for r in range(self.world_size) if (p := self._read(r)) is not None} | {self.rank: mine}
            if (len(records) == self.world_size and all(p.stack for p in records.values())) or time.monotonic() > end:
                hang = _describe(
                    records, now=time.time(), timeout_s=limit_s, world_size=self.world_size, starting=starting
                )
                return hang.message
            time.sleep(0.1)

    def _position(self, beat: _Beat, entries: Sequence[dict[str, Any]] = ()) -> Position:
        wall = time.time() - (time.monotonic() - beat.mono)
        position = Position(step=beat.step, where=beat.where, beats=beat.beats, time=wall)
        if not entries:
            return position
        last = entries[-1]
        dtypes, sizes = last.get("input_dtypes", []), last.get("input_sizes", [])
        shapes = ", ".join(f"{d.lower()}{s}" for d, s in zip(dtypes, sizes, strict=False))
        what = f"#{last.get('collective_seq_id')} {last.get('profiling_name')}({shapes})"
        pending = not last.get("retired") and last.get("state") != "completed"
        return dataclasses.replace(
            position,
            collectives=1 + max(int(e.get("record_id", 0)) for e in entries),
            collective=f"in {what}" if pending else f"none pending; last completed {what}",
        )

    def _write_stack(self, position: Position, entries: Sequence[dict[str, Any]]) -> str:
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = [
            f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()
            if not str(names.get(ident)).startswith(self._thread.name)
        ]
        recent = [
            f"  #{e.get('collective_seq_id')} {e.get('profiling_name')} retired={e.get('retired')}"
            for e in entries[-5:]
        ]
        text = "\n".join([
            f"rank {self.rank} of {self.world_size}, pid {os.getpid()} on {socket.gethostname()}: "
            f"step {position.step} in {position.where!r}; collective: {position.collective or 'unknown'}",
            "last collectives (flight recorder, newest last):", *(recent or ["  none recorded"]),
            "", "Python stacks (all threads but the watchdog's own):", *stacks,
        ])  # fmt: skip
        path = self.out_dir / f"hang-rank{self.rank}.txt" if self.out_dir else None
        if path is not None and _write(path, text):
            return str(path)
        log.error("%s", text)
        return f"stderr of rank {self.rank}"

    def _publish(self, position: Position) -> None:
        self._store_call(self.store.set, f"{self._key}{self.rank}", json.dumps(dataclasses.asdict(position)))

    def _reported(self) -> bool:
        return bool(self._store_call(self.store.check, [self._key + "report"]))

    def _read(self, rank: int) -> Position | None:
        key = f"{self._key}{rank}"
        raw = self._store_call(self.store.get, key) if self._store_call(self.store.check, [key]) else None
        return Position(**json.loads(raw)) if isinstance(raw, bytes) else None

    @staticmethod
    def _store_call(call: Callable[..., Any], *args: Any) -> Any:
        """Run a store operation; None if the store failed or timed out (the job may be going down)."""
        try:
            return call(*args)
        except RuntimeError:  # torch.distributed.DistStoreError, the store's timeouts among them
            return None


def _flight_recorder(dump_to: Path | None) -> list[dict[str, Any]]:
    """Return this process's flight-recorder entries, oldest first, and write their raw dump to ``dump_to``.

    Empty when the recorder is off (TORCH_FR_BUFFER_SIZE unset) or this torch lacks it. NCCL's recorder
    exists in CUDA builds; the generic one records gloo in recent torch (2.13 does).
    """
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return []
    for name in ("nccl_trace", "fr_trace"):
        dump_json, dump_pickle = getattr(c10d, f"_dump_{name}_json", None), getattr(c10d, f"_dump_{name}", None)
        if dump_json is None:
            continue
        try:
            entries = json.loads(dump_json(includeCollectives=True, onlyActive=False)).get("entries", [])
            if entries and dump_to is not None and dump_pickle is not None:
                _write(dump_to, dump_pickle(includeStackTraces=False))  # symbolizing them takes seconds
        except (RuntimeError, ValueError):
            continue  # a diagnosis without collectives beats none
        if entries:
            return sorted(entries, key=lambda e: int(e.get("record_id", 0)))
    return []


def _write(path: Path, data: str | bytes) -> bool:
    """Write one file of the report; False if the disk refused (the caller falls back to stderr)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
    except OSError:
        return False
    return True


def _launcher_says() -> bool:
    """Whether redline's launcher prints the diagnosis, from torchrun's error file: printed here too, it came twice."""
    return bool(os.environ.get(SAID_ERRORS_ENV)) and "TORCHELASTIC_ERROR_FILE" in os.environ


def _record_for_torchrun(message: str) -> None:
    """Write the message to torchelastic's error file, where torchrun's failure summary reads it."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    try:
        raise HangError(message)  # record_exception formats the exception being handled
    except HangError as exc:
        ErrorHandler().record_exception(exc)
