"""A bench row in a process of its own (`redline bench --isolate`), driven from the bench's process.

Rows that share a process share its memory allocator and torch.compile's caches: the order they take turns in
then weighs on their speed (on a CPU the naive loop's fp32 eager steps and a Runtime's same configuration measured
3% apart one way in one process, and at parity or the other way as processes of their own). Under ``isolate`` each
row is a process that loads the task from its spec again, builds and warms up its row, then runs the windows the
bench asks for, in the same rotating rounds: one row runs at a time, and no row's memory is another's. This is
how pyperf runs benchmarks: https://pyperf.readthedocs.io/en/latest/run_benchmark.html

``RowProcess`` is the bench's side; ``redline.bench.row_process`` is the row's (``python -m``). They talk over a
socket pair: each message one pickled object with its length before it. The row's log records come back as they
are made, and are logged here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import site
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from redline.bench.matrix import Setting
from redline.bench.memory import Peak
from redline.bench.result import Peaks, RowFacts
from redline.errors import ConfigError, RedlineError

_LENGTH = struct.Struct("!Q")
# `python -m` would put the working directory first on sys.path, before torch is imported: a profile.py or queue.py
# of the user's would stand for the standard library's. The row takes the bench's sys.path once started.
_START = "import sys; del sys.path[0]; from redline.bench.row_process import main; sys.exit(main(int(sys.argv[1])))"
OPTIONS_HINT = (
    "pass the task's options as plain values (numbers, text, lists of them) that its factory turns into objects, "
    "or bench without isolate"
)
STOP_WAIT_S = 10.0  # how long a row's process is given to end after it was asked to, before it is killed


class RowFailed(Exception):
    """A row's step failed in its own process; the message is the row's error as the bench shows it."""


class RowEnded(Exception):
    """A row's process ended without an answer (killed for memory, say)."""


class Channel:
    """Pickled objects over a socket, each after its length."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, message: object) -> None:
        data = pickle.dumps(message)
        self.sock.sendall(_LENGTH.pack(len(data)) + data)

    def recv(self) -> Any:
        (size,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
        return pickle.loads(self._exactly(size))

    def _exactly(self, size: int) -> bytes:
        chunks, left = [], size
        while left:
            chunk = self.sock.recv(min(left, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)


class RowProcess:
    """One bench row, built, warmed up and timed in a process of its own; ``run`` and ``facts`` as a Runner's."""

    def __init__(self, origin: tuple[str, dict[str, Any]], setting: Setting, job: dict[str, Any]) -> None:
        self.setting = setting
        ours, theirs = socket.socketpair()
        paths = _import_paths()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)} if paths else None
        try:  # what the task prints goes to stderr: never into --json's stdout
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _START, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=2, env=env,
            )  # fmt: skip
        finally:
            theirs.close()
        self._channel = Channel(ours)
        spec, options = origin
        self._channel.send({**job, "spec": spec, "options": options, "setting": setting, "sys_path": sys.path})

    def warm_up(self) -> tuple[Peak, int | None]:
        """Wait for the row to be built and warmed up: its warm-up's peak memory and its step's FLOPs."""
        peak, flops = self._answer()
        return peak, flops

    def run(self, steps: int) -> float:
        """Run ``steps`` steps in the row's process; their last loss (a Runner's ``run``)."""
        return float(self._ask(("run", steps)))

    def facts(self, *, compiled: bool, peaks: Peaks, want_peak: bool) -> RowFacts:
        facts: RowFacts = self._ask(("facts", compiled, peaks, want_peak))
        return facts

    def close(self, *, now: bool = False) -> None:
        """End the row's process: asked first, killed if it does not end in time (one stuck in a step); ``now``
        (the bench was stopped) terminates it at once, mid-step."""
        if now:
            self._proc.terminate()
        with contextlib.suppress(OSError):
            self._channel.send(("stop",))
        self._channel.sock.close()
        try:
            self._proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _ask(self, request: tuple[Any, ...]) -> Any:
        try:
            self._channel.send(request)
        except OSError as exc:  # the process ended since its last answer
            raise RowEnded(self._ended()) from exc
        return self._answer()

    def _answer(self) -> Any:
        """The row's answer to the last request, logging the records it sent before it; what failed there raises."""
        while True:
            try:
                kind, value = self._channel.recv()
            except (EOFError, OSError) as exc:
                raise RowEnded(self._ended()) from exc
            if kind == "log":
                logging.getLogger(value.name).handle(value)
            elif kind == "ok":
                return value
            elif kind == "interrupted":
                raise KeyboardInterrupt
            else:
                raise _raised(kind, value)

    def _ended(self) -> str:
        try:
            code = self._proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            return "the row's process stopped answering"
        told = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        hint = "; killed for memory?" if code == -9 else ""
        return f"the row's process ended without an answer ({told}{hint})"


def _raised(kind: str, value: Any) -> BaseException:
    """The exception the row's process reported: redline's own as raised there, a row's failure as its message."""
    if kind == "redline" and isinstance(value, RedlineError):
        return value
    if kind == "redline":  # one whose class does not travel: its message does
        return RedlineError(str(value))
    if kind == "config":
        return ConfigError(str(value))
    return RowFailed(str(value))


def _import_paths() -> list[str]:
    """Where the row's process finds redline as this process found it (a source tree's folder; an installed
    redline's site-packages is found without it, and put first it would stand before the standard library), then
    what PYTHONPATH already says."""
    package = os.path.realpath(Path(__file__).resolve().parents[2])  # the folder that holds redline/
    sites = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return given if package in sites else [package, *given]
