"""The batch an estimate traces: the worst case of the training set, not its first items.

A batch padded to its longest item (text, by a task's collate) holds as much memory as its largest items
make it, so a dataset whose first items are short would be weighed far below its peak. For a dataset with a
length, up to ``LOOKED_AT`` items are read (all of a smaller one, else an even sample of them) and the batch of
the largest, by their number of elements, is traced. A stream cannot be read ahead: its first batch is traced.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from redline.errors import TaskError, describe_error
from redline.runtime.contract import split_batch, user_line
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
    order = largest_first(data)
    batch, distinct = real_batch(data, size, collate, order)
    if order is None:  # every item weighs the same: the first ones are as large as any
        return batch, size, ()
    return batch, size, (f"samples differ in size: traced on the {distinct} largest of {looked_at(data)}: "
                         f"{_shapes(batch)}",)  # fmt: skip


def largest_first(data: Dataset[Any]) -> list[int] | None:
    """The indices of the items read (all of a dataset of up to ``LOOKED_AT``, else an even sample), largest first
    by their elements; None for a stream, or where every item read weighs the same (the first are as large as any)."""
    if isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
        return None
    indices = _looked_at(len(data))
    sizes = [_elements(_item(data, i)) for i in indices]
    if len(set(sizes)) <= 1:
        return None
    return [indices[k] for k in sorted(range(len(indices)), key=lambda k: sizes[k], reverse=True)]


def _item(data: Dataset[Any], index: int) -> Any:
    try:
        return data[index]
    except Exception as exc:  # the dataset's own code: a missing file, a corrupt record
        raise TaskError(
            f"reading item {index} of train_data, to find its largest items, raised {describe_error(exc)}"
            f"{user_line(exc)}\nhint: the error is in the dataset's own code; REDLINE_TRACEBACK=1 prints the whole "
            "traceback"
        ) from exc


def largest_told(data: Dataset[Any]) -> tuple[list[int] | None, list[str]]:
    """``largest_first``'s order, and the note that says each batch size was tried on those items (none without)."""
    order = largest_first(data)
    return order, ([] if order is None else [f"samples differ in size: each batch size was tried on the largest of "
                                             f"{looked_at(data)}"])  # fmt: skip


def looked_at(data: Any) -> str:
    """How many samples ``largest_first`` read, and of how many."""
    count = len(_looked_at(len(data)))
    return f"{count:,} samples" + (f" spread evenly over {len(data):,}" if count < len(data) else "")


def real_batch(
    data: Dataset[Any], size: int, collate: CollateFn | None = None, order: Sequence[int] | None = None
) -> tuple[Any, int]:
    """Collate a batch of ``size`` items, the first ``size`` of ``order`` (``largest_first``'s) where given, else from
    the start of ``data``, repeating them when there are fewer (by the task's ``collate`` when it has one).

    Returns the batch (as the Trainer's DataLoader collates it) and the number of distinct items in it.
    """
    if order is not None:
        items = [data[i] for i in order[:size]]
    elif isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
        items = list(itertools.islice(iter(data), size))
    else:
        items = [data[i] for i in range(min(size, len(data)))]
    if not items:
        raise TaskError("train_data gave no item: there is nothing to build a batch from\nhint: check the dataset")
    distinct = len(items)
    return (collate or default_collate)([items[i % distinct] for i in range(size)]), distinct


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
    if not shown:  # inputs the model takes as they come (texts it tokenizes itself): their count and longest
        texts = [len(leaf) for _, leaf in leaves if isinstance(leaf, str | bytes)]
        return f"{len(texts)} texts, the longest {max(texts)} characters" if texts else f"{len(leaves)} input values"
    return ", ".join(shown[:_SHAPES_SHOWN]) + more


def _name(path: tuple[Any, ...]) -> str:
    """A leaf's name by its keys: "input_ids", "pixels.left", "inputs[0]" (a position, under the inputs)."""
    name = re.sub(r"\['([^']*)'\]", r".\1", keystr(path)).lstrip(".")
    return name if name and not name.startswith("[") else "inputs" + name
