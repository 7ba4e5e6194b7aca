"""One command-line text read as a value of the type a parameter is annotated with (``--task-arg KEY=VALUE``).

``read_as`` returns the value or raises ValueError; ``not_read`` is the error that says what the type
takes, with an example, or for a class no text can be (a dataclass), how to take its fields instead.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any, Literal

import torch

from redline.errors import TaskSpecError, few


def not_read(key: str, text: str, hint: Any) -> TaskSpecError:
    """The error for an option's text that its annotation does not read."""
    said = f"--task-arg {key}={text!r}: the factory's option {key!r} is {_type_name(hint)}"
    unbuildable = next((member for member in union_members(hint) if _unbuildable(member)), None)
    if unbuildable is not None:  # its text was passed on as it was: a str where the factory expects a class
        expected = "; it reads none" if type(None) in union_members(hint) else ""
        return TaskSpecError(
            f"{said}, which --task-arg cannot build from a text{expected}\nhint: {_fields_hint(unbuildable)}"
        )
    return TaskSpecError(f"{said}; expected {_expected(hint)}\nhint: e.g. --task-arg {key}={_example(hint)}")


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def read_as(text: str, hint: Any) -> Any:
    """Return ``text`` as a value of type ``hint``, or raise ValueError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for member in sorted(args, key=lambda member: _lenient(member, beside_str=str in args)):
            try:
                return read_as(text, member)
            except ValueError:
                continue
        raise ValueError(text)
    if origin is Literal:
        for value in args:
            if text == str(value):
                return value
        raise ValueError(text)
    if hint is type(None) and text.strip().lower() == "none":
        return None
    if hint is bool and text.strip().lower() in _TRUE + _FALSE:
        return text.strip().lower() in _TRUE
    if hint in _SCALARS:
        return _SCALARS[hint](text)  # int("2.5") and float("fast") raise ValueError
    if hint in (type(None), bool):
        raise ValueError(text)
    return _read_structured(text, hint)


def _whole(text: str) -> int:
    """Read a whole number, also one written with an exponent (max_chars=4e5); int("2.5") raises ValueError."""
    if "e" in text.lower() and float(text).is_integer() and abs(float(text)) < 2**53:  # beyond 2**53: not exact
        return int(float(text))
    return int(text)


_SCALARS: dict[Any, Callable[[str], Any]] = {int: _whole, float: float, str: str}


def _read_structured(text: str, hint: Any) -> Any:
    """Return ``text`` as a path, a collection or a dict; as a Python literal or text for any other type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_path(hint):
        if not text.strip():
            raise ValueError(text)
        made = Path if hint is os.PathLike else hint
        return made(os.path.expanduser(text))  # `path=~/data` reaches the factory as the shell gives --out
    if (origin or hint) in _COLLECTIONS:
        return _read_collection(text, origin or hint, args)
    if (origin or hint) is dict:
        value = _literal_or_text(text)
        if not isinstance(value, dict):
            raise ValueError(text)
        key_type, value_type = args if len(args) == 2 else (None, None)
        return {_item(k, key_type): _item(v, value_type) for k, v in value.items()}
    if origin is None and isinstance(hint, type):
        return _read_class(text, hint)
    return _literal_or_text(text)  # a typing form without a reading of its own (Callable[..., X]): as before


def _read_class(text: str, hint: type) -> Any:
    """Return ``text`` as a member of an Enum, a torch dtype or device, or a Python literal that is a ``hint``
    (``complex``, ``bytes``); any other class (a dataclass, say) has no text form: ValueError, as for a bad text."""
    if issubclass(hint, enum.Enum):
        return _member(text, hint)
    if hint is torch.dtype:
        dtype = getattr(torch, text.strip().removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(text)
        return dtype
    if hint is torch.device:
        try:
            return torch.device(text.strip())
        except (RuntimeError, TypeError):
            raise ValueError(text) from None
    value = _literal_or_text(text)
    try:
        if isinstance(value, hint):
            return value
    except TypeError:  # a Protocol that isinstance cannot check
        pass
    raise ValueError(text)


def _member(text: str, kind: type[enum.Enum]) -> enum.Enum:
    """The member of ``kind`` that ``text`` names, or whose value it is (``MAX`` or ``max``), in any case if one."""
    members = kind.__members__
    if text in members:
        return members[text]
    by_value = [m for m in members.values() if text == str(m.value)]
    folded = [m for name, m in members.items() if text.strip().lower() in (name.lower(), str(m.value).lower())]
    found = by_value or (folded if len(set(folded)) == 1 else [])
    if not found:
        raise ValueError(text)
    return found[0]


def _is_path(hint: Any) -> bool:
    return hint is os.PathLike or (isinstance(hint, type) and issubclass(hint, PurePath))


def _literal_of(hint: type) -> str | None:
    """A Python literal that is a ``hint`` (``complex``, ``bytes``, ``Mapping``), or None where none is one."""
    try:
        return next((text for kind, text in _LITERALS.items() if issubclass(kind, hint)), None)
    except TypeError:  # a Protocol that issubclass cannot check
        return None


_LITERALS = {int: "4", float: "0.5", complex: "1+2j", str: "text", bytes: "b'text'", list: "[1, 2]", dict: "{'a': 1}"}


def _unbuildable(hint: Any) -> bool:
    """Whether ``hint`` is a class that no command-line text can be (a dataclass, a model's config class)."""
    if typing.get_origin(hint) is not None or not isinstance(hint, type):
        return False
    read = (type(None), bool, *_SCALARS, *_COLLECTIONS, dict, torch.dtype, torch.device)
    return not (hint in read or issubclass(hint, enum.Enum) or _is_path(hint) or _literal_of(hint) is not None)


def _fields_hint(kind: type) -> str:
    """The fix for an option of a class ``kind`` that a text cannot build: its fields as the factory's parameters."""
    name = kind.__name__
    try:
        fields = [
            p for p in inspect.signature(kind).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        fields = []
    if not fields:
        return (
            f"make what builds a {name} the factory's own parameters (bool, int, float, str, ...), and build it there"
        )
    shown = [_parameter_text(p) for p in fields[:3]] + (["..."] if len(fields) > 3 else [])
    built = ", ".join(f"{p.name}={p.name}" for p in fields[:3]) + (", ..." if len(fields) > 3 else "")
    what = "fields" if dataclasses.is_dataclass(kind) else "arguments"
    return (
        f"make {name}'s {what} the factory's own parameters and build it there: "
        f"def make({', '.join(shown)}): ... {name}({built}), then --task-arg {fields[0].name}=..."
    )


def _parameter_text(parameter: inspect.Parameter) -> str:
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        text = parameter.name
    else:
        written = annotation if isinstance(annotation, str) else _bare_name(annotation)
        text = f"{parameter.name}: {written}"
    return text if parameter.default is inspect.Parameter.empty else f"{text} = {parameter.default!r}"


_COLLECTIONS: dict[Any, type] = {list: list, tuple: tuple, set: set, frozenset: frozenset}


def _lenient(hint: Any, *, beside_str: bool) -> int:
    """How much text a union's member takes: those that refuse a text are tried first ("none" is None), ``str`` last.

    Beside ``str``, a path, a device and a dtype come after it, so are never tried: they only re-express a text the
    factory said it takes as is (``str | os.PathLike`` keeps ``s3://bucket`` whole, ``str | torch.dtype`` ``half``).
    """
    if hint is str:
        return 3
    if beside_str and (_is_path(hint) or hint in (torch.dtype, torch.device)):
        return 4
    if _is_path(hint):
        return 2
    if isinstance(hint, type) and typing.get_origin(hint) is None and issubclass(hint, enum.Enum):
        return 0
    known = (type(None), bool, int, float, *_COLLECTIONS, dict, torch.dtype, torch.device)
    return 0 if hint in known or typing.get_origin(hint) in (Literal, *known) else 1


def _read_collection(text: str, kind: Any, args: tuple[Any, ...]) -> Any:
    """Read ``1,2`` or ``[1, 2]`` as a ``kind`` (list, tuple, set), each item as its annotation says."""
    if text.strip()[:1] in ("[", "(", "{"):
        value = _literal_or_text(text)
        if not isinstance(value, list | tuple | set | frozenset):
            raise ValueError(text)
        items = list(value)
    else:
        items = [piece.strip() for piece in text.split(",")] if text.strip() else []
    if len(args) == 2 and args[1] is Ellipsis:  # tuple[int, ...]
        types_ = [args[0]] * len(items)
    elif kind is tuple and args:  # tuple[int, str]: one item per type
        if len(items) != len(args):
            raise ValueError(text)
        types_ = list(args)
    else:
        types_ = [args[0] if args else None] * len(items)
    return _COLLECTIONS[kind](_item(item, item_type) for item, item_type in zip(items, types_, strict=True))


def _item(value: Any, hint: Any) -> Any:
    """One item of a collection as ``hint`` reads it: a text as a command-line text, a value by its own text."""
    if hint is None or hint in (Any, object):
        return _literal_or_text(value) if isinstance(value, str) else value
    return read_as(value if isinstance(value, str) else repr(value), hint)


def read_untyped(text: str) -> Any:
    """Read an option without a type: true, false and none in any case as Python's (``augment=false`` for a factory's
    ``augment=None`` is off, not the text 'false', which is true), else a Python literal, else the text."""
    word = text.strip().lower()
    return _WORDS[word] if word in _WORDS else _literal_or_text(text)


_WORDS = {"true": True, "false": False, "none": None}


def _literal_or_text(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text  # a bare word is a string: --task-arg name=tiny


def union_members(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _type_name(hint: Any) -> str:
    names = [_bare_name(m) for m in union_members(hint)]
    if len(names) == 1:
        return ("an " if names[0][0].lower() in "aeiou" else "a ") + names[0]
    return "annotated " + " | ".join(names)


def _bare_name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) is Literal:
        return f"Literal[{', '.join(map(repr, typing.get_args(hint)))}]"
    if typing.get_origin(hint) is not None:  # list[int] (whose __name__ is just "list")
        return str(hint).replace("typing.", "")
    if hint in (torch.dtype, torch.device):  # not a bare "dtype"
        return f"torch.{hint.__name__}"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


_EXPECTED = {
    bool: "true or false", int: "a whole number", float: "a number", type(None): "none", str: "text",
    torch.dtype: "a dtype's name: float32, bfloat16, float16, float64, int64, ...",
    torch.device: "a device: cpu, cuda, cuda:N or mps",
}  # fmt: skip
_EXAMPLES = {
    bool: "true", int: "4", float: "0.001", type(None): "none", str: "text", torch.dtype: "bfloat16",
    torch.device: "cpu",
}  # fmt: skip


def _expected(hint: Any) -> str:
    return " or ".join(_expected_one(member) for member in union_members(hint))


def _expected_one(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(str(v) for v in args)
    if _is_path(hint):
        return "a path"
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        names, values = list(hint.__members__), [str(m.value) for m in hint.__members__.values()]
        by_value = f" (or its value: {few(values, 8)})" if values != names else ""
        return f"one of {few(names, 8)}{by_value}"
    if origin is None and isinstance(hint, type) and _literal_of(hint) is not None and hint not in _EXPECTED:
        return f"a Python literal that is a {_bare_name(hint)}"
    if (origin or hint) is dict:
        return "a Python dict"
    if (origin or hint) in _COLLECTIONS:
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"{len(args)} values separated by commas: " + ", ".join(map(_expected_one, args))
        each = f", each {_expected_one(args[0])}" if args else ""
        return f"values separated by commas{each}"
    return _EXPECTED.get(hint, _bare_name(hint))


def _example(hint: Any) -> str:
    first = union_members(hint)[0]
    origin, args = typing.get_origin(first), typing.get_args(first)
    if origin is Literal:
        return str(args[0])
    if _is_path(first):
        return "path/to/file"
    if origin is None and isinstance(first, type) and issubclass(first, enum.Enum):
        return next(iter(first.__members__))
    if first not in _EXAMPLES and origin is None and isinstance(first, type):
        return _literal_of(first) or "..."
    if (origin or first) is dict:
        key, value = (repr(read_as(_example(a), a)) for a in args) if len(args) == 2 else ("'a'", "1")
        return f"{{{key}: {value}}}"
    if (origin or first) in _COLLECTIONS:
        if origin is tuple and args and args[-1] is not Ellipsis:
            return ",".join(map(_example, args))
        return ",".join([_example(args[0]) if args else "1"] * 2)
    return _EXAMPLES.get(first, "...")
