"""Command-line flags derived from the options dataclasses, so that a flag and its field cannot drift apart.

Each options field declared with ``redline.config.option`` carries its help and, where it differs
from the field's name, its flag. ``flags(RuntimeOptions)`` turns the fields into typer parameters;
``values(RuntimeOptions, parsed)`` picks the parsed values back out for the dataclass's constructor.
A command built with ``command`` takes its own parameters plus the derived ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import re
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer

from redline.config import positive_int
from redline.errors import ConfigError, DeviceUnavailableError, invalid

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One derived command-line option: the field it sets and the parameter typer fills."""

    owner: type
    field: str
    name: str  # the flag as typed, ``--max-steps``
    parameter: inspect.Parameter


def flags(
    owner: type,
    *,
    prefix: str = "",
    only: Collection[str] | None = None,
    optional: bool = False,
    said_defaults: bool = False,
) -> list[Flag]:
    """Return the flags of ``owner``'s command-line fields (those ``option(..., cli=True)`` declared).

    ``prefix`` goes before each parameter and flag name (``early_stopping_patience``); ``optional``
    makes every flag default to None, meaning "not given" (the dataclass's own default then applies), and
    ``said_defaults`` has each flag's help say that default, where not giving the flag leaves it to the dataclass.
    """
    hints = typing.get_type_hints(owner)
    out = []
    for field in dataclasses.fields(owner):
        meta = field.metadata
        if not field.init or not meta.get("cli", False) or (only is not None and field.name not in only):
            continue
        name = prefix + field.name
        flag = meta.get("flag") or "--" + name.replace("_", "-")
        kind = _cli_type(hints[field.name])
        default = None if optional else field.default
        if kind is bool and not optional:
            info = typer.Option(f"{flag}/--no-{flag.removeprefix('--')}", help=meta["help"])
        else:
            # The dataclass checks the bound, so a value below it is said as every refusal is (--max-steps=0 is
            # not allowed; expected a positive integer), not in the parser's words; the help still shows it.
            least = meta.get("min")
            shown = meta["help"] if least is None else f"{meta['help'].rstrip('.')} (at least {least})."
            if said_defaults and field.default is not None and "default" not in shown:  # typer shows None: nothing
                shown = f"{shown.rstrip('.')} (default: {field.default})."
            # A path is read by given_path (an empty one refused), shown as the parser would show it.
            parser, metavar = (given_path, "<path>") if kind is Path else (None, _choices(hints[field.name]))
            info = typer.Option(flag, help=shown, metavar=metavar, parser=parser)
        annotation: Any = Annotated.__class_getitem__((kind if default is not None else kind | None, info))  # type: ignore[attr-defined]
        parameter = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
        out.append(Flag(owner, field.name, flag, parameter))
    return out


def _at_least_one(param: typer.CallbackParam, value: int | None) -> int | None:
    """Refuse a count below 1 as every bound is refused (``--steps=0 is not allowed; expected a positive
    integer``), not in the parser's words."""
    if value is not None and param.name is not None:
        with said_by_flags(**{param.name: max(param.opts, key=len)}):
            positive_int(param.name, value)
    return value


def given_path(text: str | Path) -> Path:
    """Read a path flag's value; an empty one is refused (``Path("")`` is the current directory, where ``--out ""``
    would write the run's files): the command line says it by its flag (cli.main.unparsed). A leading ``~`` is
    the home directory, as the shell makes it where it can (it does not in ``--out=~/x``, nor quoted)."""
    if text == "":
        raise ValueError("an empty path")
    return Path(os.path.expanduser(text))  # Path.expanduser raises for ~nosuchuser


def given_file(example: str) -> Callable[[str | Path], Path]:
    """The parser of a file flag (an output's), reading its value as ``given_path``; one that ends with a slash names
    a directory (``Path`` would drop the slash, and the file be written under the directory's name): refused by its
    flag (cli.main.unparsed), the hint naming ``example`` in it, a file name the flag takes (``trace.json.gz``)."""

    def parse(text: str | Path) -> Path:
        path = given_path(text)
        if str(text).endswith("/"):
            allowed = "a file, not a directory (it ends with /)"
            raise invalid("path", str(text), allowed, f"name a file in it, e.g. {text}{example}")
        return path

    return parse


def count(help: str, *, least: bool = True, **kwargs: Any) -> Any:
    """A ``typer.Option`` for a command's own count (``--steps``): at least 1, as its help says (unless ``least``
    is False: a help that says its own least)."""
    said = f"{help.rstrip('.')} (at least 1)." if least else help
    return typer.Option(callback=_at_least_one, help=said, **kwargs)


def _cli_type(hint: Any) -> Any:
    """Return the type typer parses a field as.

    A Literal (a choice) is read as text, and the dataclass checks it: its error names the flag and the
    nearest choice (``--precision bf16`` -> did you mean --precision 'bf16-mixed'?).
    """
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if len(args) == 1:
            return _cli_type(args[0])
        return str  # several types (nproc: N or "auto"): the dataclass reads the text
    if origin is Literal:
        return str
    if origin is tuple:
        return list[str]
    if hint in (int, float, str, bool, Path):
        return hint
    raise TypeError(f"no command-line type for {hint!r}")


def _choices(hint: Any) -> str | None:
    """The help's placeholder for a choice, ``[auto|on|off]``, and for a repeatable flag its item's (``<str>``,
    where the parser would show the Python type ``<list[str]>``); None for any other field."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _choices(args[0])
    if typing.get_origin(hint) is tuple and args:
        return _choices(args[0]) or f"<{getattr(args[0], '__name__', 'str')}>"
    return "[" + "|".join(map(str, args)) + "]" if typing.get_origin(hint) is Literal else None


def values(owner: type, parsed: Mapping[str, Any], *, prefix: str = "", optional: bool = False) -> dict[str, Any]:
    """Return the keyword arguments for ``owner`` from parsed flags, lists as tuples.

    With ``optional`` (flags made by ``flags(..., optional=True)``), only the flags that were given.
    """
    out = {}
    for flag in flags(owner, prefix=prefix, optional=optional):
        value = parsed.get(flag.parameter.name)
        if flag.parameter.name not in parsed or (optional and value is None):
            continue
        out[flag.field] = tuple(value) if isinstance(value, list | tuple) else value
    return out


def build(owner: type[T], parsed: Mapping[str, Any], *, prefix: str = "", optional: bool = False, **given: Any) -> T:
    """Return ``owner`` made from the parsed flags (and ``given``), a refused value named by its flag.

    The dataclass checks its values under its fields' names (``clip_grad_norm=-1.0``); the user typed
    ``--clip-grad-norm -1``, so the error says that instead.
    """
    try:
        with said_by_flags(**spellings(owner, prefix=prefix, optional=optional)):
            return owner(**values(owner, parsed, prefix=prefix, optional=optional), **given)
    except ConfigError as error:
        raise _with_default(owner, error, prefix=prefix) from None


def _with_default(owner: type, error: ConfigError, *, prefix: str) -> ConfigError:
    """Give a flag's refusal that came without a hint one: the flag's default, the value to go back to (``e.g.
    --nproc 'auto'``), or leaving the flag out where its default is decided later (None) or is no one value."""
    if error.parts is None or error.parts[3]:
        return error
    flag, value, allowed, _ = error.parts
    field = next((f.field for f in flags(owner, prefix=prefix) if f.name == flag), None)
    if field is None:  # a refusal of two fields together, or of one off the command line
        return error
    default = next(f.default for f in dataclasses.fields(owner) if f.name == field)
    typed = type(default) in (int, float, str)  # a value one writes after the flag (not None, a list, a switch)
    hint = f"e.g. {flag} {default!r}" if typed else f"leave {flag} out for its default"
    return invalid(flag, value, allowed, hint)


def spellings(owner: type, *, prefix: str = "", optional: bool = False) -> dict[str, str]:
    """The flag of each of ``owner``'s fields, by every name the field goes by (for ``said_by_flags``)."""
    spelled = {}
    for flag in flags(owner, prefix=prefix, optional=optional):  # early_stopping.patience: --early-stopping-patience
        for name in (flag.field, flag.parameter.name, flag.name.removeprefix("--").replace("-", "_")):
            spelled[name] = flag.name
    return spelled


@contextlib.contextmanager
def said_by_flags(**flag_of: str) -> Iterator[None]:
    """Say a ConfigError raised inside again by the flag of the argument it names (``budget_s=0.0`` as
    ``--budget=0.0``); ``flag_of`` maps the argument's name to its flag."""
    try:
        yield
    except ConfigError as error:
        if error.parts is None or error.parts[0].replace(".", "_") not in flag_of:
            raise
        name, value, allowed, hint = error.parts
        flag = flag_of[name.replace(".", "_")]
        # None is how Python leaves an option out; on the command line the flag is left out.
        allowed = re.sub(r",? or None\b", "", allowed)
        # the text may name other arguments too: say their flags
        raise invalid(flag, value, _flagged(allowed, flag_of), _flagged(hint, {name: flag, **flag_of})) from None
    except DeviceUnavailableError as error:  # devices='cuda' asked of a machine without one: say --devices 'cuda'
        raise DeviceUnavailableError(_flagged(str(error), flag_of)) from error.__cause__


def _flagged(text: str, flag_of: Mapping[str, str]) -> str:
    """``text`` with each ``argument=value`` it names said as ``--flag value``."""
    for argument, flag in flag_of.items():
        text = re.sub(rf"(?<![\w.]){re.escape(argument)}=", f"{flag} ", text)
    return text


def command(function: Callable[..., Any], *groups: list[Flag]) -> Callable[..., Any]:
    """Return ``function`` with its own parameters followed by every group's flags, for typer to read.

    ``function`` takes its own parameters and ``**parsed`` for the derived ones.
    """

    @functools.wraps(function)
    def wrapper(**parsed: Any) -> Any:
        return function(**parsed)

    own = [
        p
        for p in inspect.signature(function, eval_str=True).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    derived = [flag.parameter for group in groups for flag in group]
    names = [p.name for p in [*own, *derived]]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TypeError(f"{function.__name__}: options named twice: {repeated}")
    wrapper.__signature__ = inspect.Signature([p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + derived)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {}
    return wrapper


# The two options every command that takes a Task shares.
TaskSpec = Annotated[
    str, typer.Option(metavar="SPEC", help="Task spec: example:digits, pkg.module:factory or file.py:factory.")
]
TaskArgs = Annotated[
    list[str] | None,
    typer.Option(
        "--task-arg",
        metavar="KEY=VALUE",
        help=(
            "An option for the task factory, read as its parameter's annotation (or default) says; an untyped one "
            "reads true/false/none in any case as True/False/None, a number as a number, else text. Repeatable."
        ),
    ),
]
# The model and engine flags `redline serve` and `redline predict` share.
ModelSpec = Annotated[
    str, typer.Argument(metavar="SPEC", help="Model spec: example:digits, pkg.module:factory or file.py:factory.")
]
Weights = Annotated[
    Path | None,
    typer.Option(
        metavar="PATH",
        parser=given_path,
        help="A safetensors file to load into the model, or a checkpoint directory (step-NNNNNNNN, FSDP ones too).",
    ),
]
EngineDevice = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps.")]
EnginePrecision = Annotated[
    str, typer.Option(help="auto, fp32, bf16-mixed, fp16-mixed (autocast), bf16-true or fp16-true (weights cast once).")
]
EngineCompile = Annotated[str, typer.Option(help="torch.compile: auto, on or off.")]
EngineGraphs = Annotated[str, typer.Option(help="A CUDA graph per batch size: auto, on or off.")]
EngineMeasure = Annotated[str, typer.Option(help="Time the candidate settings (auto) or plan by rules (off).")]
EngineLayout = Annotated[str, typer.Option(help="channels_last (NHWC) for a convolutional model: auto, on or off.")]
# The flag of each engine argument, for said_by_flags (the device is checked as ``devices``).
ENGINE_FLAGS = {
    "devices": "--device", "precision": "--precision", "compile": "--compile", "cuda_graphs": "--cuda-graphs",
    "measure": "--measure", "channels_last": "--channels-last",
}  # fmt: skip
