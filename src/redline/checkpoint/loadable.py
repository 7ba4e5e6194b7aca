"""What a checkpoint may hold of the caller's own state: what ``torch.load(weights_only=True)`` reads back.

Loading never unpickles arbitrary objects, so a value that plain pickling writes but the safe loader
refuses (a NumPy number, a datetime, a Path) would make a checkpoint that saves and then cannot be
resumed from. It is refused when saved, naming where it sits.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from redline.checkpoint.layout import CheckpointError
from redline.checkpoint.reading import parsing, unparsed
from redline.errors import invalid

HINT = (
    "store plain values (float(x), int(x), x.tolist(), str(path), when.isoformat()) or tensors (torch.as_tensor(x)): "
    "a checkpoint is read back with torch.load(weights_only=True), which unpickles nothing else"
)


def check_loadable(state: Mapping[str, Any], name: str = "extra") -> None:
    """Raise a ConfigError naming the first value of ``state`` that a safe load would refuse; write nothing."""
    if _loads(state):
        return
    where, value = _culprit(state, name)
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    raise invalid(where, kind, "tensors and plain Python values (numbers, text, lists, tuples, dicts)", HINT)


def load_safely(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``; a file holding what that refuses (written by hand, or by a redline
    that did not check) is a CheckpointError that says what to do, not the unpickler's own message."""
    try:
        with parsing(path, passing=pickle.UnpicklingError):  # a file cut short or garbled: named, not torch's error
            loaded: dict[str, Any] = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if not found and re.search(r"Unsupported operand|invalid load key|truncated", str(exc)):  # garbled bytes
            raise unparsed(path, exc) from exc
        raise CheckpointError(
            f"{path}: holds a value that loading without unpickling arbitrary objects refuses"
            f"{f' (a {found.group(1)})' if found else ''}\nhint: if you trust the file, read it with "
            "torch.load(path, weights_only=False), replace that value with a plain one or a tensor, and save it again"
        ) from None
    return loaded


def _loads(value: Any) -> bool:
    """Whether ``value`` comes back through torch.save and torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    try:
        torch.save(_hollow(value), buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except (pickle.UnpicklingError, pickle.PicklingError, TypeError, AttributeError, RuntimeError):
        return False
    return True


def _hollow(value: Any) -> Any:
    """``value`` with every tensor replaced by an empty one of its dtype: the check serialises no data."""
    if isinstance(value, torch.Tensor):
        return torch.empty(0, dtype=value.dtype)
    if isinstance(value, dict):  # of its own class: the safe load refuses a defaultdict, where a dict loads
        hollowed = copy.copy(value)
        hollowed.update((key, _hollow(item)) for key, item in value.items())
        return hollowed
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_hollow(item) for item in value)
    return value  # another kind of mapping too, data and all: whether it loads is its class's


def _culprit(value: Any, where: str) -> tuple[str, Any]:
    """The path (``extra['stats'][0]``) and the value of the innermost part that does not load."""
    parts: list[tuple[str, Any]] = []
    if isinstance(value, Mapping):
        parts = [(f"{where}[{key!r}]", item) for key, item in value.items()]
    elif isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        parts = [(f"{where}[{index}]", item) for index, item in enumerate(value)]
    for path, item in parts:
        if not _loads(item):
            return _culprit(item, path)
    return where, value
