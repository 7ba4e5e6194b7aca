"""Options that belong to their owner: documented dataclass fields, and the checks they share.

Each component keeps a frozen, keyword-only options dataclass beside the code that uses it
(``RuntimeOptions``, ``TrainerConfig``, ``LaunchConfig``); its fields carry their command-line help
(``option(...)``), so the CLI derives its flags from them instead of listing the options again.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import redline.errors as errors
from redline.errors import invalid

T = TypeVar("T")


def option(default: Any, help: str, *, flag: str | None = None, cli: bool = True, min: int | None = None) -> Any:
    """Declare an options field: its default, its one-line help, and its command-line flag.

    ``flag`` overrides the flag derived from the field's name (``--max-steps`` from ``max_steps``);
    ``cli=False`` keeps a field off the command line (an object only Python can pass). ``min`` is the
    smallest number the flag takes: the command line refuses less by the flag's name (the dataclass
    checks its own values too, for Python callers).
    """
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "cli": cli, "min": min})


def positive_int(name: str, value: object, *, optional: bool = False) -> None:
    """Check that ``value`` is a positive integer (or None when ``optional``); raise ConfigError if not."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise invalid(name, value, "a positive integer" + (" or None" if optional else ""), _example(name, 1))


SEEDS = (-(2**63), 2**64 - 1)  # the seeds torch.manual_seed takes


def seed_number(name: str, value: object, *, optional: bool = False) -> None:
    """Check that ``value`` is a seed torch takes (an integer in ``SEEDS``), or None when ``optional``."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not SEEDS[0] <= value <= SEEDS[1]:
        taken = f"an integer from {SEEDS[0]} to {SEEDS[1]} (what torch takes)" + (", or None" if optional else "")
        raise invalid(name, value, taken, _example(name, 0))


def non_negative_int(name: str, value: object) -> None:
    """Check that ``value`` is an integer >= 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise invalid(name, value, "an integer >= 0", _example(name, 0))


def positive_number(name: str, value: object, *, optional: bool = False) -> None:
    """Check that ``value`` is a finite number > 0 (or None when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, int | float) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        number = "a finite number" if isinstance(value, float) and not math.isfinite(value) else "a number"
        raise invalid(name, value, f"{number} > 0" + (" or None" if optional else ""), _example(name, 1.0))


def non_negative_number(name: str, value: object, allowed: str = "a finite number >= 0") -> None:
    """Check that ``value`` is a finite number >= 0; ``allowed`` says so in the option's own unit."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not (math.isfinite(value) and value >= 0):
        raise invalid(name, value, allowed, _example(name, 0.0))


def one_of(name: str, value: object, allowed: Sequence[object]) -> None:
    """Check that ``value`` is one of ``allowed``; a typo's hint is the choice it most likely meant.

    Of a switch (``auto``, ``on``, ``off``), a yes-or-no word (true, yes, 1; false, no, 0) means ``on`` or
    ``off``: the hint says so, where spelling alone would suggest ``auto``.
    """
    if value in allowed:
        return
    switched = _switch_meant(value) if "on" in allowed and "off" in allowed else None
    if switched is None:
        raise errors.one_of(name, value, allowed)
    raise invalid(name, value, "one of " + ", ".join(map(repr, allowed)), f"did you mean {name}={switched!r}?")


_ON_WORDS = ("true", "yes", "y", "1", "enable", "enabled")
_OFF_WORDS = ("false", "no", "n", "0", "disable", "disabled")


def _switch_meant(value: object) -> str | None:
    """The switch a yes-or-no word means: "on" for true, yes or 1; "off" for false, no or 0; else None."""
    word = str(value).strip().lower() if isinstance(value, str | bool | int) else ""
    return "on" if word in _ON_WORDS else "off" if word in _OFF_WORDS else None


def boolean(name: str, value: object) -> None:
    """Check that ``value`` is True or False (not 1, not "yes")."""
    if not isinstance(value, bool):
        raise invalid(name, value, "True or False", _example(name, True))


def call_refused(function: Any, count: int) -> str:
    """Why ``function`` cannot be called with ``count`` positional arguments ("StepLR takes 1 argument: missing a
    required argument: 'step_size'"), or "" where it can, or has no signature to read (a builtin: calling it tells).

    A run that calls it so later would raise the TypeError from its own line, as if the bug were the caller's.
    """
    # A module is called through its forward: nn.Module.__call__'s own signature (*args, **kwargs) takes anything.
    torch = sys.modules.get("torch")  # not imported here: a module of torch's exists only where torch was imported
    called = function.forward if torch is not None and isinstance(function, torch.nn.Module) else function
    try:
        inspect.signature(called).bind(*range(count))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValueError) or "not a callable" in str(exc):  # no signature to read
            return ""
        called = getattr(function, "__name__", None) or type(function).__name__
        return f"{called} cannot be called with {count} argument{'s' * (count != 1)} ({exc})"
    return ""


def with_changes(owner: type[T], base: T | None, changes: Mapping[str, Any], *, what: str, hint: str = "") -> T:
    """Return ``base`` (or ``owner``'s defaults) with ``changes``; a name ``owner`` lacks is a clear error.

    ``what`` names the options in the message ("a Runtime option"); ``hint`` is shown with it.
    """
    if base is not None and not isinstance(base, owner):
        raise invalid("options", type(base).__name__, f"a {owner.__name__}, or its fields as keywords")
    fields = dataclasses.fields(owner)  # type: ignore[arg-type]
    known = {field.name for field in fields if field.init and not field.metadata.get("internal")}  # not the user's
    unknown = sorted(set(changes) - known)
    if unknown:
        near = errors.nearest(unknown[0], sorted(known))
        meant = f"did you mean {near}={changes[unknown[0]]!r}?" if near else ""
        raise invalid(unknown[0], changes[unknown[0]], f"{what}: " + ", ".join(sorted(known)), hint or meant)
    return dataclasses.replace(base, **changes) if base is not None else owner(**changes)  # type: ignore[type-var]


def _example(name: str, value: object) -> str:
    return f"e.g. {name}={value!r}"
