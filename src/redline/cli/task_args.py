"""``--task-arg KEY=VALUE``: the command line's texts read as the types a task factory declares.

``redline.load_task`` takes real values from Python callers; the command line has only texts, so
each is converted by the annotation of the factory's parameter of that name.
"""

from __future__ import annotations

import contextlib
import inspect
import shlex
import sys
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from redline.cli.signals import stopped_by_signal
from redline.cli.typed_text import not_read, read_as, read_untyped, union_members
from redline.errors import ONE_STEP, TrainingError, invalid
from redline.serve.servable import Servable, load_servable_with
from redline.task import Task, call_factory, check_options, find_factory


def one_step(task: str, task_arg: list[str] | None, devices: str | None, batch_size: int | None) -> str:
    """The `redline train` of one step of what a command ran, as typed: the task and its arguments, and the device
    and batch size where one was named (a batch that does not fit fails there, not at the task's own size)."""
    typed = ["redline", "train", "--task", task, *(part for arg in task_arg or [] for part in ("--task-arg", arg))]
    typed += ["--batch-size", str(batch_size)] if batch_size is not None else []
    typed += ["--devices", devices] if devices not in (None, "auto") else []
    return shlex.join([*typed, "--max-steps", "1"])


@contextlib.contextmanager
def one_step_named(
    task: str, task_arg: list[str] | None, devices: str | None, batch_size: int | None
) -> Iterator[None]:
    """A failing task's error with the one-step run that shows it (``ONE_STEP``) as typed (``one_step``), not SPEC."""
    try:
        yield
    except TrainingError as error:
        if ONE_STEP not in str(error):
            raise
        raise TrainingError(str(error).replace(ONE_STEP, one_step(task, task_arg, devices, batch_size))) from (
            error.__cause__
        )


def load_given_task(spec: str, pairs: list[str] | None, *, stdout_kept: bool = False) -> Task:
    """The Task ``--task SPEC --task-arg KEY=VALUE ...`` names; SIGTERM or Ctrl-C while its factory runs (reading a
    dataset can take minutes) stops the command with a line saying so, not a bare exit code. ``stdout_kept``: what
    the task's file prints as it loads goes to stderr (``prints_to_stderr``)."""
    with stopped_by_signal("loading the task", "nothing had run yet"), prints_to_stderr(stdout_kept):
        factory, options = given_factory(spec, pairs or [])
        return call_factory(spec, factory, options)


@contextlib.contextmanager
def prints_to_stderr(asked: bool) -> Iterator[None]:
    """Where ``asked`` (stdout carries --json's result, or predict's array), send what the user's code prints meanwhile
    (a factory's word on its data) to stderr: on stdout it made the JSON unreadable."""
    if not asked:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def check_given_task(spec: str, pairs: list[str] | None) -> None:
    """Raise the TaskSpecError loading the task would, without running the factory (a launcher checks once, before
    it starts workers that would each fail the same way)."""
    factory, options = given_factory(spec, pairs or [])
    check_options(spec, factory, options)


def load_given_servable(
    spec: str, pairs: list[str] | None, weights: Path | None, *, stdout_kept: bool = False
) -> Servable:
    """The Servable ``SPEC --task-arg KEY=VALUE ...`` names, with ``weights`` loaded into its model; ``stdout_kept``
    as for ``load_given_task``."""
    texts = task_arg_texts(pairs or [])
    with prints_to_stderr(stdout_kept):
        return load_servable_with(spec, lambda factory: convert_task_args(factory, texts), weights=weights)


def given_factory(spec: str, pairs: list[str]) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The factory a spec names and its ``--task-arg`` options, read by its annotations.

    The spec's module is imported once: a task file's top level (data drawn at import, a print) runs once, as it
    does without options.
    """
    texts = task_arg_texts(pairs)
    factory = find_factory(spec)
    return factory, convert_task_args(factory, texts)


def task_arg_texts(pairs: list[str]) -> dict[str, str]:
    """Turn repeated ``KEY=VALUE`` strings into the texts of keyword options, each KEY once."""
    texts: dict[str, str] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            example = f"{key}=VALUE" if key.isidentifier() else "n_layer=4"  # --task-arg width: the value is missing
            raise invalid("--task-arg", pair, "KEY=VALUE with KEY a Python identifier", f"e.g. --task-arg {example}")
        if key in texts and texts[key] != text:  # which one was meant? the last would win unsaid
            raise invalid(
                "--task-arg", pair, f"each KEY once; {key} is also given as --task-arg {key}={texts[key]}",
                f"keep the one you mean, e.g. --task-arg {pair}",
            )  # fmt: skip
        texts[key] = text
    return texts


def convert_task_args(factory: Callable[..., Any], texts: Mapping[str, str]) -> dict[str, Any]:
    """Convert command-line texts (``--task-arg KEY=VALUE``) to the types the factory annotates.

    ``bool`` reads true/false, yes/no, on/off or 1/0 in any case; ``int``, ``float`` and ``str``
    read as such (``name=123`` stays the text "123"), an ``int`` also a whole number with an
    exponent (``max_chars=4e5``); a ``Path`` reads as a path; ``X | None`` (or ``X = None``) also
    reads none; a ``Literal`` reads one of its values; ``list[X]``, ``tuple[X, ...]`` and ``set[X]``
    read comma-separated values (``sizes=1,2``) or a Python literal (``sizes=[1, 2]``), each item
    read as ``X``; a ``dict`` reads a Python literal; an ``Enum`` a member's name or value; a
    ``torch.dtype`` a dtype's name (``bfloat16``), a ``torch.device`` a device; another class a
    Python literal that is one (``complex``), and a class no text can be (a dataclass) is refused
    with the hint to take its fields as options. Beside ``str`` in a union, a path, a dtype or a
    device is not read: the text stays as given (``str | os.PathLike`` keeps ``s3://bucket``). An
    option without an annotation reads as the type of its default where that is a bool, int, float
    or str; else true, false and none (any case) read as True, False and None, and any other text
    as a Python literal or else as text (``name=tiny``); one with an annotation not listed here
    reads as a Python literal or else as text. A text that does not convert is a TaskSpecError
    naming the option, its type and the text.
    """
    hints = _option_types(factory)
    options = {}
    for key, text in texts.items():
        hint = hints.get(key)
        try:
            if hint is None:  # no annotation, nor a default of a type to read by
                options[key] = read_untyped(text)
            else:
                options[key] = read_as(text, hint)
        except ValueError:
            raise not_read(key, text, hint) from None
    return options


def _option_types(factory: Callable[..., Any]) -> dict[str, Any]:
    """Return the annotation of each of the factory's parameters that has one, resolved where it can be."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    target = vars(factory).get("__init__", factory) if isinstance(factory, type) else factory
    try:
        hints = typing.get_type_hints(target)
    except (NameError, AttributeError, TypeError, SyntaxError):
        # One annotation names what exists only for type checkers, or the factory is an object with
        # __call__: resolve each parameter's annotation on its own, and keep those that resolve.
        scope = getattr(inspect.unwrap(target), "__globals__", {})
        hints = {name: _resolve(p.annotation, scope) for name, p in parameters.items()}
    untyped = (None, Any, object, inspect.Parameter.empty)
    typed = {
        name: _or_none(hint) if parameters[name].default is None else hint
        for name, hint in hints.items()
        if name in parameters and hint not in untyped
    }
    # Without an annotation, the default's type: `augment=False` read "false" as the text, which is true.
    plain = {name: type(p.default) for name, p in parameters.items() if type(p.default) in (bool, int, float, str)}
    return {**plain, **typed}


def _or_none(hint: Any) -> Any:
    """``n: int = None`` means an int or None, as type checkers long read it: its default reads as "none" too."""
    try:
        return hint if type(None) in union_members(hint) else hint | None
    except TypeError:  # not a type (an annotation such as "fast"): read as before
        return hint


def _resolve(annotation: Any, scope: dict[str, Any]) -> Any:
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, dict(scope))  # what typing.get_type_hints does, one annotation at a time
    except (NameError, AttributeError, TypeError, SyntaxError):
        return None
