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
    """Return the number of samples in ``batch``.

    Read first as its tensors' first axis, where every list of tensors or dicts in it fits that count (as its
    length, one per sample, or as its tensors' shared first axis, fields of the batch); else as the length of a list
    of one dict per sample (a detection batch collated as ``tuple(zip(*samples))``: a tuple of images and one of
    target dicts, whose images' shared first axis is their channels); else as any count every part fits. Where none
    fits, the first axis of the first tensor (a shared scale or mask beside the inputs is given whole to each part),
    but where a list of one dict per sample disagrees, a TaskError: slicing would cut an image's channels.
    """
    stacked, lists = _evidence(batch)
    first = next((int(t.shape[0]) for t in stacked if t.dim() and t.shape[0]), None)
    counts = [first] if first is not None else []
    counts += [s.length for s in lists if s.samples] + [s.axis for s in lists if s.axis is not None]
    counts += [s.length for s in lists]
    for n in counts:
        if (first is None or first == n) and all(s.fits(n) for s in lists):
            return n
    if any(s.samples for s in lists):
        raise TaskError(
            "train_step(step_fn, batch) cannot tell how many samples the batch holds: its lists of one dict per "
            f"sample are {sorted({s.length for s in lists if s.samples})} long, and its tensors' first axes say "
            f"{first if first is not None else 'nothing'}\nhint: keep one list of per-sample targets as long as "
            "the images, e.g. (torch.stack(images), list(targets)), or pass micro_batch=None"
        )
    anywhere = next((int(t.shape[0]) for t in tensors_in(batch) if t.dim() and t.shape[0]), None)
    if anywhere is not None:
        return anywhere
    raise TaskError(
        f"train_step(step_fn, batch) got a batch without samples to split ({type(batch).__name__}); expected "
        "tensors whose first axis is the batch, alone or in tuples, lists or dicts\n"
        "hint: pass the batch itself, e.g. rt.train_step(step_fn, (inputs, targets))"
    )


@dataclass(frozen=True)
class _List:
    """A list (or tuple) of tensors or dicts in a batch: its length, the first axis all its tensors share (None where
    they share none), and whether it can only be one dict per sample."""

    length: int
    axis: int | None
    samples: bool

    def fits(self, n: int) -> bool:
        """Whether the batch can hold ``n`` samples with this list in it: one entry per sample or, where its dicts are
        not the samples', every tensor of it holding them all."""
        return self.length == n or (not self.samples and self.axis == n)


def _evidence(batch: Any) -> tuple[list[torch.Tensor], list[_List]]:
    """The tensors of ``batch`` outside its lists of tensors or dicts, and those lists. At the top of the batch only a
    list of dicts counts: a top-level (inputs, targets) pair is the batch's fields."""
    stacked: list[torch.Tensor] = []
    lists: list[_List] = []

    def visit(item: Any, top: bool) -> None:
        if isinstance(item, torch.Tensor):
            stacked.append(item)
        elif (entries := _sample_list(item, top)) is not None:
            lists.append(_List(len(entries), _shared_axis(entries), _dict_per_sample(entries)))
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


def _dict_per_sample(entries: list[Any]) -> bool:
    """Whether ``entries`` can only be one dict per sample: dicts holding a plain number or string (a sample's label;
    a batch's field would hold every sample's), or at least two dicts of the same keys (a batch's
    fields are one dict, or differ in their keys: {'input_ids'} and {'labels'})."""
    if not all(isinstance(entry, Mapping) for entry in entries):
        return False
    if any(isinstance(v, int | float | str) for entry in entries for v in entry.values()):
        return True
    return len(entries) > 1 and len({tuple(entry) for entry in entries}) == 1


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
    """Whether ``item`` is a list (or tuple) of one tensor or one dict per sample: ``total`` of them, dicts that can
    only be the samples' or entries whose tensors do not all have a first axis of ``total`` (which would make them
    fields of the batch, each holding every sample)."""
    entries = _sample_list(item, top)
    if entries is None or len(entries) != total:
        return False
    return _dict_per_sample(entries) or _shared_axis(entries) != total
