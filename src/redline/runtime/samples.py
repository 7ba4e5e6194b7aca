"""A batch's samples: how many it holds, and the batch of some of them (a micro-batch).

A batch is read as its tensors' first axis where they agree, and as its lists of one tensor or one dict
per sample where it holds such lists (torchvision's detection batches: ``tuple(zip(*samples))``), so a
micro-batch gets its own samples' images and targets, never some channels of every image.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from redline.errors import TaskError
from redline.runtime.contract import count_samples
from redline.runtime.transfer import map_tensors, tensors_in

__all__ = ["batch_length", "count_batch", "take"]


def count_batch(inputs: Any, targets: Any) -> int:
    """The number of samples in an (inputs, targets) batch, as a micro-batch split reads it; where its parts agree on
    no count (a graph's node and edge tensors), the first axis of the inputs' first tensor (``count_samples``)."""
    try:
        return batch_length((inputs, targets))
    except TaskError:
        return count_samples(inputs)


def batch_length(batch: Any) -> int:
    """Return the number of samples in ``batch``: the first axis of its first tensor that has one, where every list of
    one tensor or one dict per sample in it agrees; else the one count every part agrees on (a detection batch collated
    as ``tuple(zip(*samples))``: a tuple of images of their own sizes and one of target dicts). A batch whose parts
    agree on no count, or on several, is a TaskError: slicing it would cut an image's channels, not its samples."""
    stacked, lists = _evidence(batch)
    first = next((t.shape[0] for t in stacked if t.dim() and t.shape[0]), None)
    if not lists:
        if first is not None:
            return int(first)
        raise TaskError(
            f"train_step(step_fn, batch) got a batch without samples to split ({type(batch).__name__}); expected "
            "tensors whose first axis is the batch, alone or in tuples, lists or dicts\n"
            "hint: pass the batch itself, e.g. rt.train_step(step_fn, (inputs, targets))"
        )
    fields = [first] if first is not None else [uniform for _, uniform in lists if uniform is not None][:1]
    for n in fields + [length for length, _ in lists]:  # the batch's own fields first, as a batch without lists
        if all(length == n or uniform == n for length, uniform in lists) and (first is None or first == n):
            return int(n)
    raise TaskError(
        "train_step(step_fn, batch) cannot tell how many samples the batch holds: its lists of one tensor or one "
        f"dict per sample are {sorted({length for length, _ in lists})} long, and its tensors' first axes say "
        f"{first if first is not None else 'nothing'}\nhint: stack the images into one tensor (N, C, H, W) and "
        "keep one list of per-sample targets, e.g. (torch.stack(images), list(targets)), or pass micro_batch=None"
    )


def _evidence(batch: Any) -> tuple[list[torch.Tensor], list[tuple[int, int | None]]]:
    """The tensors of ``batch`` outside its lists of one tensor or one dict per sample, and each such list's length
    with the first axis all its tensors share (None where they share none: then it can only be one per sample). At
    the top of the batch only a list of dicts counts: a top-level (inputs, targets) pair is the batch's fields."""
    stacked: list[torch.Tensor] = []
    lists: list[tuple[int, int | None]] = []

    def visit(item: Any, top: bool) -> None:
        if isinstance(item, torch.Tensor):
            stacked.append(item)
        elif (entries := _sample_list(item, top)) is not None:
            lists.append((len(item), _shared_axis(entries)))
        elif isinstance(item, list | tuple):
            for x in item:
                visit(x, False)
        elif isinstance(item, Mapping):
            for x in item.values():
                visit(x, False)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            for f in dataclasses.fields(item):
                visit(getattr(item, f.name), False)

    visit(batch, True)
    return stacked, lists


def _sample_list(item: Any, top: bool) -> list[Any] | None:
    """The entries of ``item`` where it may be a list of one tensor or one dict per sample (None where not)."""
    if not isinstance(item, list | tuple) or hasattr(item, "_fields") or not item:
        return None
    if all(isinstance(x, Mapping) for x in item) or (not top and all(isinstance(x, torch.Tensor) for x in item)):
        return list(item)
    return None


def _shared_axis(entries: list[Any]) -> int | None:
    """The first axis every tensor of ``entries`` has, where they all have one and no dict of them holds a number or a
    string (a sample's label, 0-d or plain, marks them one per sample: a batch's field would hold all the samples')."""
    axes = set()
    for entry in entries:
        if isinstance(entry, Mapping) and any(isinstance(v, int | float | str) for v in entry.values()):
            return None
        axes |= {t.shape[0] if t.dim() else None for t in tensors_in(entry)}
    return axes.pop() if len(axes) == 1 and None not in axes else None


def take(batch: Any, start: int, end: int, total: int) -> Any:
    """Return samples ``start:end`` of ``batch``: each tensor whose first axis is ``total`` sliced (a view), each
    list of ``total`` plain values (a string field of the samples, as default_collate batches it) cut alike, and
    so is each list of one tensor or one dict per sample (ragged targets: a detection model's boxes)."""
    if start == 0 and end == total:
        return batch
    cut = _Cut(start, end, total)
    if _per_sample(batch, total, top=True):  # a list of the samples' dicts
        return batch[start:end]
    if isinstance(batch, list | tuple) and not hasattr(batch, "_fields"):  # the batch's own fields: never its samples
        return type(batch)(cut(item) for item in batch)
    return cut(batch)


@dataclass(frozen=True)
class _Cut:
    start: int
    end: int
    total: int

    def __call__(self, item: Any) -> Any:
        if _per_sample(item, self.total):
            return item[self.start : self.end]
        return map_tensors(item, self._tensor, self._values, inside=self._inside)

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[self.start : self.end] if tensor.dim() and tensor.shape[0] == self.total else tensor

    def _values(self, values: list[Any] | tuple[Any, ...]) -> Any:
        return values[self.start : self.end] if len(values) == self.total else values

    def _inside(self, item: Any) -> Any:
        return item[self.start : self.end] if _per_sample(item, self.total) else None


def _per_sample(item: Any, total: int, *, top: bool = False) -> bool:
    """Whether ``item`` is a list (or tuple) of one tensor or one dict per sample: ``total`` of them, whose tensors do
    not all have a first axis of ``total`` (which would make them fields of the batch, each holding every sample)."""
    entries = _sample_list(item, top)
    return entries is not None and len(entries) == total and _shared_axis(entries) != total
