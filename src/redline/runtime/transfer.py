"""Moving nested batches to a device."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch


def device_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (a no-op where calls are synchronous): what a timing
    wraps each timed block in."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def move_to(batch: Any, device: torch.device, *, non_blocking: bool = False, channels_last: bool = False) -> Any:
    """Return ``batch`` with every tensor on ``device``.

    Tensors may sit in tuples, lists, dicts, namedtuples and dataclasses, nested to any depth;
    anything else passes through unchanged. With ``channels_last``, 4-d floating tensors (images)
    are also laid out NHWC. ``non_blocking`` only overlaps the copy when the source is pinned.
    """

    def move(item: torch.Tensor) -> torch.Tensor:
        if channels_last and item.dim() == 4 and item.is_floating_point():
            return item.to(device, non_blocking=non_blocking, memory_format=torch.channels_last)
        return item.to(device, non_blocking=non_blocking)

    return map_tensors(batch, move)


def move_batch(
    batch: Any, device: torch.device, *, non_blocking: bool = False, channels_last: bool = False, whole: bool = True
) -> Any:
    """``move_to`` for a loader's batch: with ``channels_last``, an (inputs, targets) pair has its inputs laid out NHWC
    and its targets not (a segmentation mask a loss views as ``target.view(len(target), -1)`` keeps NCHW); a batch of
    another shape (a dict, a triple) is laid out ``whole``, or not at all, where which of its tensors the model takes
    is not known (a tensor alone is the model's input)."""
    pair = isinstance(batch, tuple | list) and len(batch) == 2 and not hasattr(batch, "_fields")  # not a namedtuple
    if not (channels_last and pair):
        laid = channels_last and (whole or isinstance(batch, torch.Tensor))
        return move_to(batch, device, non_blocking=non_blocking, channels_last=laid)
    inputs = move_to(batch[0], device, non_blocking=non_blocking, channels_last=True)
    targets = move_to(batch[1], device, non_blocking=non_blocking)
    return (inputs, targets) if isinstance(batch, tuple) else [inputs, targets]


def map_tensors(
    batch: Any,
    function: Callable[[torch.Tensor], torch.Tensor],
    values: Callable[[list[Any] | tuple[Any, ...]], Any] | None = None,
    *,
    inside: Callable[[Any], Any] | None = None,
) -> Any:
    """Return ``batch`` with ``function`` applied to every tensor, its containers rebuilt as they were.

    Tensors may sit in tuples, lists, dicts, namedtuples and dataclasses, nested to any depth;
    anything else passes through unchanged, but for ``values``: applied, where given, to each list or
    tuple of plain values (strings, numbers: default_collate's batch of a field that holds no tensor).
    ``inside``, where given, is asked first of each item below the top: what it returns, unless None,
    stands for the item whole (nothing in it is mapped).
    """

    def apply(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return function(item)
        if inside is not None and item is not batch and (whole := inside(item)) is not None:
            return whole
        if isinstance(item, tuple) and hasattr(item, "_fields"):  # namedtuple
            return type(item)(*(apply(x) for x in item))
        if values is not None and isinstance(item, list | tuple) and item and all(map(_plain, item)):
            return values(item)
        if isinstance(item, list | tuple):
            return type(item)(apply(x) for x in item)
        if isinstance(item, dict):  # a copy keeps a subclass's extras (defaultdict's factory)
            applied = copy.copy(item)
            applied.update((k, apply(v)) for k, v in item.items())
            return applied
        if isinstance(item, Mapping):
            return type(item)({k: apply(v) for k, v in item.items()})  # type: ignore[call-arg]
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            fresh = copy.copy(item)  # every field, init=False ones too; frozen ones through object
            for f in dataclasses.fields(item):
                object.__setattr__(fresh, f.name, apply(getattr(item, f.name)))
            return fresh
        return item

    return apply(batch)


def _plain(item: Any) -> bool:
    return item is None or isinstance(item, str | bytes | int | float | complex)


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """Return every tensor inside a nested batch."""
    found: list[torch.Tensor] = []

    def visit(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, list | tuple):
            for x in item:
                visit(x)
        elif isinstance(item, Mapping):
            for x in item.values():
                visit(x)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            for f in dataclasses.fields(item):
                visit(getattr(item, f.name))

    visit(batch)
    return found
