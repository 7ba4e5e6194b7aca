"""The batch an estimate traces: the worst case of the training set, not its first items.

A batch padded to its longest item (text, by a task's collate) holds as much memory as its largest items
make it, so a dataset whose first items are short would be weighed far below its peak. For a dataset with a
length, up to ``LOOKED_AT`` items are read (all of a smaller one, else an even sample of them) and the batch of
the largest, by their number of elements, is traced. A stream cannot be read ahead: its first batch is traced.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves
from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate

from redline.errors import TaskError
from redline.memory.search import real_batch
from redline.runtime.contract import split_batch
from redline.task import CollateFn

LOOKED_AT = 4096  # items read to find the largest: an in-memory dataset's are read in well under a second
_SHAPES_SHOWN = 4


def trace_batch(data: Any, size: int, collate: CollateFn | None) -> tuple[Any, int, tuple[str, ...]]:
    """The batch to trace, collated from real items, its rows, and a note on which items where it is not simply
    the first: one item when every leaf is a tensor and there is no collate (its shapes and dtypes are the batch's,
    grown to ``size`` rows on fake tensors: torch's collate stacks items of one shape), else ``size`` items, the
    largest found where they differ in size."""
    one, _ = real_batch(data, 1, collate)
    if collate is None and all(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(one)):
        return one, 1, ()  # a large batch would be a large real allocation, and collating it a long wait
    if isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
        batch = real_batch(data, size, collate)[0]
        note = f"train_data is a stream: traced on its first batch ({_shapes(batch)}); later items of other sizes "
        return batch, size, (note + "are not searched for the largest",)
    indices = _looked_at(len(data))
    sizes = [_elements(data[i]) for i in indices]
    if len(set(sizes)) <= 1:  # every item weighs the same: the first ones are as large as any
        return real_batch(data, size, collate)[0], size, ()
    largest = sorted(range(len(indices)), key=lambda k: sizes[k], reverse=True)[:size]
    items = [data[indices[k]] for k in largest]
    batch = (collate or default_collate)([items[i % len(items)] for i in range(size)])
    looked = f"{len(indices):,} samples" + (f" spread evenly over {len(data):,}" if len(indices) < len(data) else "")
    return batch, size, (f"samples differ in size: traced on the {len(items)} largest of {looked}: {_shapes(batch)}",)


def _looked_at(count: int) -> list[int]:
    """The indices read: all of ``count`` up to ``LOOKED_AT``, else ``LOOKED_AT`` spread evenly over them."""
    if count <= LOOKED_AT:
        return list(range(count))
    return [i * count // LOOKED_AT for i in range(LOOKED_AT)]


def _elements(item: Any) -> int:
    """An item's size: its tensors' and arrays' elements, a string's characters, one per other value (so a list of
    token ids counts its length)."""
    total = 0
    for leaf in tree_leaves(item):
        if isinstance(leaf, torch.Tensor | np.ndarray):
            total += leaf.numel() if isinstance(leaf, torch.Tensor) else leaf.size
        elif isinstance(leaf, str | bytes):
            total += len(leaf)
        else:
            total += 1
    return total


def _shapes(batch: Any) -> str:
    """The shapes of a batch's input tensors, named by their keys: "input_ids (16, 512), attention_mask (16, 512)"."""
    try:
        inputs, _ = split_batch(batch, "train_data")
    except TaskError:  # the trace itself says what is wrong with the batch; the note shows it whole
        inputs = batch
    leaves, _ = tree_flatten_with_path(inputs)
    shown = [f"{_name(path)} {tuple(leaf.shape)}" for path, leaf in leaves if isinstance(leaf, torch.Tensor)]
    more = f" and {len(shown) - _SHAPES_SHOWN} more" if len(shown) > _SHAPES_SHOWN else ""
    return ", ".join(shown[:_SHAPES_SHOWN]) + more


def _name(path: tuple[Any, ...]) -> str:
    """A leaf's name by its keys: "input_ids", "pixels.left", "inputs[0]" (a position, under the inputs)."""
    name = re.sub(r"\['([^']*)'\]", r".\1", keystr(path)).lstrip(".")
    return name if name and not name.startswith("[") else "inputs" + name
