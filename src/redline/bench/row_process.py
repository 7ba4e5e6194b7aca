"""One bench row's process under ``isolate``, started by bench/isolate.py with the socket ``FD`` it reads.

It reads its job from the socket ``FD``, loads the task from its spec, builds and warms up its row as the bench does
in its own process (``warm_up``), then answers the bench's requests (run N steps, the row's facts) until asked to
stop. Its log records go to the bench's process, which logs them; anything it prints goes to stderr.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import sys
import traceback
from typing import Any

import torch

from redline.bench.compile_cache import reset_compiler
from redline.bench.isolate import OPTIONS_HINT, Channel
from redline.bench.loops import Runner
from redline.bench.rows import row_error, row_facts
from redline.bench.run import warm_up
from redline.errors import ConfigError, RedlineError, TaskSpecError, describe_error, traceback_asked
from redline.runtime.seed import seed_everything
from redline.task import load_task


class _Forward(logging.Handler):
    """Send each record to the bench's process, its message formatted here (its arguments may not travel)."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = record.getMessage(), None
            if record.exc_info:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
                record.exc_info = None
            self.channel.send(("log", record))
        except Exception:  # a record that cannot travel is dropped, as a handler's error would be
            self.handleError(record)


def main(fd: int) -> int:
    channel = Channel(socket.socket(fileno=fd))
    try:
        job = channel.recv()
    except (EOFError, OSError):  # the bench ended before it sent the job
        return 1
    except Exception as exc:  # an option of the task this process cannot rebuild (a class of the bench's __main__)
        said = f"the task's options could not be rebuilt in a row's process ({describe_error(exc)})"
        _tell(channel, "redline", TaskSpecError(f"{said}\nhint: {OPTIONS_HINT}"))
        return 1
    redline_log = logging.getLogger("redline")
    redline_log.handlers, redline_log.propagate = [_Forward(channel)], False
    redline_log.setLevel(job["log_level"])
    try:
        runner = _warmed(job, channel)
        if runner is not None:
            _serve(runner, channel)
    except KeyboardInterrupt:  # a Ctrl-C reaches every process of the terminal's: the bench says it, once
        _tell(channel, "interrupted", None)
        return 130
    except OSError:  # the bench is gone (killed): nothing is left to answer
        return 1
    return 0


def _warmed(job: dict[str, Any], channel: Channel) -> Runner | None:
    """Load the task and warm up the row; tell the bench its peak and FLOPs, or why it failed (None then)."""
    sys.path[:] = job["sys_path"]  # the user's modules, found as the bench found them
    torch.set_num_threads(job["threads"])
    setting = job["setting"]
    try:
        seed_everything(job["seed"])  # a factory's unseeded data: each row's process builds the same
        task = load_task(job["spec"], **job["options"])
        if setting.compile is not False:  # compiled, or auto's row, which may compile: timed as a fresh run's
            reset_compiler([setting.device])
        runner, memory, flops = warm_up(task, setting, job["window"], job["planned"], job["seed"])
    except Exception as exc:
        _failed(channel, exc)
        return None
    channel.send(("ok", (memory, flops)))
    return runner


def _serve(runner: Runner, channel: Channel) -> None:
    while True:
        try:
            request = channel.recv()
        except EOFError:  # the bench ended
            return
        if request[0] == "stop":
            return
        try:
            if request[0] == "run":
                answer: Any = runner.run(request[1])
            else:
                _, compiled, peaks, want_peak = request
                answer = row_facts(runner, compiled=compiled, peaks=peaks, want_peak=want_peak)
        except Exception as exc:
            _failed(channel, exc)
            continue
        channel.send(("ok", answer))


def _failed(channel: Channel, exc: Exception) -> None:
    """Tell the bench what failed: redline's own error as raised (its message, where its class cannot travel), a
    setting this device refuses as a ConfigError's message, anything else as the row's error line. With
    REDLINE_TRACEBACK=1 the row's traceback is printed here first: the bench's process has only its own stack."""
    if traceback_asked():
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, ConfigError):
        _tell(channel, "config", str(exc))
    elif isinstance(exc, RedlineError):
        _tell(channel, "redline", exc if _travels(exc) else str(exc))
    else:
        _tell(channel, "failed", row_error(exc))


def _travels(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return False
    return True


def _tell(channel: Channel, kind: str, value: object) -> None:
    with contextlib.suppress(OSError):  # the bench is gone
        channel.send((kind, value))
