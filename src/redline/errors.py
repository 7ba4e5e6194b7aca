"""The package's errors: one base class, each message saying what was passed, what is allowed, and the fix."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import hashlib
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import ParamSpec, TypeVar, cast

# The folder where the workers of one launcher mark the errors they printed, so that an error every
# rank meets alike (a bug in the model, a wrong option) is printed once, not once per GPU.
SAID_ERRORS_ENV = "REDLINE_SAID_ERRORS"
# The hint of a rank whose collective broke because another rank had stopped (failed, or was killed) first
PEER_STOPPED = (
    "another rank stopped first; its log says why (with --max-restarts K the job restarts from the last checkpoint)"
)
PEER_STOPPED_MARK = "peer-stopped-"  # in SAID_ERRORS_ENV's folder, + "ATTEMPT-RANK": its error was PEER_STOPPED
ONE_STEP = "redline train --task SPEC --max-steps 1"  # a failing task's one-step run; the command line says it as typed


class RedlineError(Exception):
    """Base class of every error redline raises on purpose."""

    exit_code = 2  # what the command line exits with


class ConfigError(RedlineError, ValueError):
    """An argument or option has a value redline cannot use.

    One built by ``invalid`` keeps its parts in ``parts``, the tuple ``(name, value, allowed, hint)`` (None for
    one built otherwise), so that the command line can say it again by the flag's name instead of the field's.
    """

    parts: tuple[str, object, str, str] | None = None


class DeviceUnavailableError(RedlineError, RuntimeError):
    """A device was asked for that this machine does not have or cannot use that way."""


class StoppedBySignal(RedlineError):
    """A run stopped early by SIGTERM or SIGINT: the command line exits with 128 + the signal's number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention (130, 143): a scheduler reads it as "terminated"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where a command takes it as Ctrl-C raises KeyboardInterrupt (cli/signals.py): code that keeps
    what a Ctrl-C leaves behind (a bench's finished batch sizes, a tune's measured axes) keeps it for a scheduler's
    SIGTERM too, and code that wraps the user's errors (``except Exception``) lets it pass."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def interrupting_signal(exc: KeyboardInterrupt) -> int:
    """The signal behind a KeyboardInterrupt: SIGTERM for a Terminated, else SIGINT (Ctrl-C)."""
    return exc.signum if isinstance(exc, Terminated) else int(signal.SIGINT)


class NotedInterrupts:
    """The interrupts raised inside ``noting_interrupts``, each noted before its handler raised it."""

    def __init__(self) -> None:
        self.signals: list[int] = []

    def caught(self) -> None:
        """The caller caught the interrupt raised: forget it."""
        self.signals.clear()

    def raise_lost(self) -> None:
        """Raise again an interrupt noted but never seen by the caller, which Python printed and dropped where it was
        raised (inside a weakref callback or ``__del__``, of which a torch.compile runs many)."""
        if self.signals:
            signum = self.signals[0]
            self.signals.clear()
            raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


@contextlib.contextmanager
def noting_interrupts() -> Iterator[NotedInterrupts]:
    """Within, a SIGINT, SIGTERM or SIGHUP whose handler raises (Python's KeyboardInterrupt, the command line's
    Terminated) is noted as it raises, so that a block which ends normally though one was raised can raise it again
    (``raise_lost``); a signal ignored or left to its default is left so. Outside the main thread nothing is noted."""
    noted = NotedInterrupts()
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the command line takes the last two as Ctrl-C
        handler = signal.getsignal(signum)
        if callable(handler):

            def note(number: int, frame: FrameType | None, handler: Callable[..., object] = handler) -> None:
                try:
                    handler(number, frame)
                except KeyboardInterrupt:  # a handler of the caller's own that raises nothing is left so
                    noted.signals.append(number)
                    raise

            previous[signum] = signal.signal(signum, note)
    try:
        yield noted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class TaskSpecError(RedlineError, ValueError):
    """A task spec string could not be loaded into a Task."""


class TaskError(RedlineError, ValueError):
    """A Task's data, loss or metric gave something the Trainer cannot use (an item that is not a pair, say)."""


class TrainingError(RedlineError, RuntimeError):
    """Training cannot go on: a non-finite loss, a failing forward, or a peer that stopped."""


class InferenceError(RedlineError, RuntimeError):
    """The model raised while redline ran it for inference (`redline predict`): what ran, and the user's line."""


class ServableError(RedlineError, ValueError):
    """A Servable's model, preprocess or postprocess gave what the engine cannot use (not a tensor, other rows)."""


class OutOfMemory(TrainingError):
    """The device ran out of memory and the run could not go on: not even one sample fits, or no recovery was asked."""


P = ParamSpec("P")
T = TypeVar("T")


def wrapping_errors(func: Callable[P, Iterator[T]]) -> Callable[P, contextlib.AbstractContextManager[T]]:
    """``contextlib.contextmanager`` for a generator that raises redline's error ``from`` the user's exception.

    contextlib takes a RuntimeError (a TrainingError is one) whose __cause__ is the StopIteration thrown in for
    PEP 479's wrapping of it, and re-raises the user's StopIteration raw, the TrainingError lost (CPython's
    ``_GeneratorContextManager.__exit__``); PEP 479's own wrapping is a RuntimeError itself, and that alone is it.
    """

    @functools.wraps(func)
    def manager(*args: P.args, **kwargs: P.kwargs) -> _Wrapping[T]:
        return _Wrapping(cast(Generator[T, None, None], func(*args, **kwargs)))

    return manager


class _Wrapping(contextlib.AbstractContextManager[T]):
    def __init__(self, gen: Generator[T, None, None]) -> None:
        self._gen = gen

    def __enter__(self) -> T:
        return next(self._gen)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> bool:
        if value is None:
            next(self._gen, None)  # the code after the yield: the generator yields once
            return False
        try:
            self._gen.throw(value)
        except StopIteration:  # the generator returned: the exception is suppressed
            return True
        except BaseException as exc:
            wrapped = type(exc) is RuntimeError and exc.__cause__ is value  # PEP 479's: the StopIteration re-raised
            if exc is value or wrapped:
                value.__traceback__ = tb
                return False  # raised on as it came
            raise
        raise RuntimeError("a wrapping_errors generator yielded again after throw()")


def invalid(name: str, value: object, allowed: str, hint: str = "") -> ConfigError:
    """Build a ConfigError in the house format: passed -> allowed -> hint."""
    message = f"{name}={value!r} is not allowed; expected {allowed}"
    if hint:
        message += f"\nhint: {hint}"
    error = ConfigError(message)
    error.parts = (name, value, allowed, hint)
    return error


def nearest(value: object, allowed: Iterable[object]) -> object | None:
    """The allowed value a mistyped ``value`` most likely meant, or None: the one it begins (``bf16`` for
    ``bf16-mixed``; of several, the closest in spelling), else the closest in spelling (``ddpp`` for ``ddp``), case
    aside (``TASKS`` for ``TASK``)."""
    if not isinstance(value, str) or not value:
        return None
    named = {str(choice).lower(): choice for choice in allowed}
    begun = [text for text in named if text.startswith(value.lower())]
    close = begun if len(begun) == 1 else difflib.get_close_matches(value.lower(), begun or named, n=1)
    return named[close[0]] if close else None


def one_of(name: str, value: object, allowed: Sequence[object]) -> ConfigError:
    """Build the error for ``value`` that is none of ``allowed``; its hint is the choice it most likely meant."""
    parts = [part.strip() for part in value.split(",")] if isinstance(value, str) and "," in value else []
    near = nearest(value, allowed)
    if len(parts) > 1 and all(part in map(str, allowed) for part in parts):
        hint = (
            f"one value here, not a list: give {parts[0]!r}, then {parts[1]!r} in another run"
            " (redline bench times several side by side)"
        )
    elif near is not None:
        hint = f"did you mean {name}={near!r}?"
    else:
        hint = f"e.g. {name}={allowed[0]!r}"
    return invalid(name, value, "one of " + ", ".join(map(repr, allowed)), hint)


def refuse_inside_event_loop(blocking: str, hint: str) -> None:
    """Refuse a call that runs an event loop of its own (``blocking`` says whose) from inside a running one, where
    asyncio's own error would not say what to do (a Jupyter cell, an async function); ``hint`` does."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop runs here, as it should be
        return
    raise ConfigError(
        f"{blocking}, and was called inside a running event loop (a Jupyter cell, an async function)\nhint: {hint}"
    )


TRACEBACK_ENV = "REDLINE_TRACEBACK"  # set to 1: an error also prints the traceback that led to it


def traceback_asked() -> bool:
    """Whether the user asked for whole tracebacks (REDLINE_TRACEBACK=1), beside the one-line errors."""
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def innermost(exc: BaseException) -> BaseException:
    """The innermost cause of a wrapped exception (compiler errors wrap the real failure)."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    while inner is not None:
        exc = inner
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
    return exc


def describe_error(exc: BaseException) -> str:
    """One line naming an exception: ``Type: first line``, for the innermost cause of a wrapped one
    (compiler errors wrap the real failure)."""
    exc = innermost(exc)
    return f"{type(exc).__name__}: {first_line(exc)}".strip(": ")


def few(names: Sequence[str], most: int) -> str:
    """``names`` joined for a message, the first ``most`` shown and the rest counted: "a, b, c and 4 more"."""
    shown = ", ".join(names[:most])
    return f"{shown} and {len(names) - most} more" if len(names) > most else shown


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message that is not blank ("" if none): what a one-line report quotes."""
    return next((line for line in str(exc).splitlines() if line.strip()), "")


WORKER_TRACEBACK = "Original Traceback (most recent call last):"  # what torch puts before a loader worker's own
_FRAME = re.compile(r'^  File "([^"]+)", line (\d+), in (.+)\n(?:    (\S.*)\n)?', re.MULTILINE)


def worker_failure(exc: BaseException) -> tuple[str, str] | None:
    """An error a DataLoader worker raised, as torch raises it again in the training process: the message of the
    worker's own (its traceback's last line, without the type) and its user's line (as ``user_line`` gives it),
    both of which torch's first line ("Caught KeyError in DataLoader worker process 1.") leaves out. None for
    any other error."""
    text = str(exc)
    if WORKER_TRACEBACK not in text:
        return None
    tail = text.split(WORKER_TRACEBACK, 1)[1]
    said = next((ln for ln in reversed(tail.splitlines()) if ln.strip() and not ln.startswith(" ")), "")
    said = said.removeprefix(f"{type(exc).__name__}: ") or said
    frames = [f for f in _FRAME.findall(tail + "\n") if users_file(f[0])]
    return said, _at(*frames[-1]) if frames else ""


PACKAGE = Path(__file__).parent  # redline's own code, but for the built-in examples' models (a user's model as any)
EXAMPLES = PACKAGE / "examples"


def own_code(filename: str) -> bool:
    """Whether ``filename`` is redline's own code; the built-in examples are models like the user's, not redline's."""
    return Path(filename).is_relative_to(PACKAGE) and not Path(filename).is_relative_to(EXAMPLES)


def raised_in_redline(exc: BaseException) -> bool:
    """Whether redline's own code raised ``exc``: its innermost frame is redline's, not the user's or a library's.

    An exception from the user's model, loss or function, or from torch under them, ends in their
    frames (a torch layer's forward, an autograd function); one that ends in redline's frame came
    from redline itself (a bug of its own, or an error it raised on purpose).
    """
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and own_code(frames[-1].filename)


def user_line(exc: BaseException) -> str:
    """The innermost frame of the traceback outside torch and redline, as an indented 'at FILE:LINE' line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if users_file(f.filename)]
    if not frames:
        return ""
    frame = frames[-1]
    return _at(frame.filename, frame.lineno, frame.name, frame.line)


def users_file(filename: str) -> bool:
    """Whether a traceback's frame in ``filename`` is the user's: not torch's, not redline's, and not code Python
    made (a "<string>" frame: a dataclass's __init__)."""
    torch = sys.modules.get("torch")  # not imported: none of its frames can be in the traceback
    skip = (str(PACKAGE),) + ((str(Path(torch.__file__).parent),) if torch and torch.__file__ else ())
    return not filename.startswith((*skip, "<"))


def _at(filename: str, lineno: int | str | None, name: str, code: str | None) -> str:
    """A frame as the indented 'at FILE:LINE in NAME: code' line messages end with."""
    return f"\n  at {filename}:{lineno} in {name}" + (f": {code.strip()}" if code else "")


def mark_peer_stopped(message: str) -> None:
    """Tell the launcher that this worker's error says another rank stopped first (``PEER_STOPPED``): where every
    failed rank of a machine says so, the cause was on another machine, whose output says why."""
    folder, rank = os.environ.get(SAID_ERRORS_ENV), os.environ.get("RANK")
    attempt = _attempt()  # an earlier attempt's marks tell nothing of the last
    if folder and rank is not None and PEER_STOPPED in message:
        with contextlib.suppress(OSError):
            (Path(folder) / f"{PEER_STOPPED_MARK}{attempt}-{rank}").touch()


def _attempt() -> str:
    """Which of torchrun's attempts this worker belongs to (0 before any restart)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def first_to_say(message: str) -> bool:
    """Whether this process should print ``message``: False only for a worker whose launcher's folder shows
    that another worker of the same attempt has printed the same message already.

    Marking is an exclusive create, so of the workers that meet the same error at once exactly one prints
    it; an attempt torchrun restarts says its errors again.
    """
    folder = os.environ.get(SAID_ERRORS_ENV)
    if not folder:
        return True
    attempt = _attempt()
    mark = Path(folder) / hashlib.sha256(f"{attempt}\n{message}".encode()).hexdigest()[:32]
    try:
        mark.open("x").close()
    except FileExistsError:
        return False
    except OSError:  # no folder to mark in: printing twice beats printing nothing
        return True
    return True
