"""The check that every rank of a launched job was given the same settings.

Each node of a multi-node job runs its own command line. Ranks told to train for different numbers of
steps wait for each other at the end until the backend's timeout (30 minutes for gloo); ranks given
different learning rates train apart without a word; ranks given different data (another validation fraction,
a split seeded by the rank) train on sets of other lengths, or validate on what another rank trains on. The Trainer
compares the settings of every rank at set-up, and refuses to train where they differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import ConcatDataset, IterableDataset, Subset, TensorDataset

from redline.errors import ConfigError
from redline.parallel.collectives import gather_objects
from redline.parallel.env import DistEnv
from redline.runtime.optimizer import group_options
from redline.runtime.options import LEFT_OUT
from redline.runtime.sampling import data_size
from redline.task import Task, model_fingerprint
from redline.train.config import TrainerConfig

# Settings a host may set for itself: where a shared directory is mounted, what its terminal shows, how many
# cores feed its loader, how long its own watchdog waits. None changes what is trained or when the ranks meet; nor
# does checkpoint_minutes, since the ranks vote on a checkpoint any rank's clock calls for.
_PER_HOST = frozenset({
    "out_dir", "progress", "loggers", "memory_history", "checkpoint_minutes", "hang_timeout_s", "hang_start_timeout_s",
    "runtime.devices", "runtime.loader_workers",
})  # fmt: skip


def settings(config: TrainerConfig, task: Task, model: nn.Module) -> dict[str, str]:
    """The settings every rank must share before the model is wrapped, by name: the Trainer's and Runtime's options,
    the task's, its data (``data_settings``) and the model's structure."""
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "runtime"}
    options |= {
        f"runtime.{f.name}": getattr(config.runtime, f.name)
        for f in dataclasses.fields(config.runtime)
        if not f.metadata.get("internal")  # the record of what was left out: said with its options below
    }
    options["keep_checkpoints"] = config.checkpoints_kept  # left out reads 3, as --keep-checkpoints 3 does
    shared = {name: repr(value) for name, value in options.items() if name not in _PER_HOST}
    for name, default in LEFT_OUT.items():  # given its default's value, it wins over a tune where left out does not
        if getattr(config.runtime, name) == default:
            shared[f"runtime.{name}"] += " (given)" if config.runtime.given(name) else " (left out)"
    shared |= {"task": task.name, "task batch_size": repr(task.batch_size), "task epochs": repr(task.epochs)}
    shared |= data_settings(task)
    # not the modules' plain attributes, which a model may set per rank (self.device = f"cuda:{rank}"), nor the
    # bytecode of their forwards, which hosts on other Python versions compile apart
    shared["model (structure and shapes)"] = model_fingerprint(model, settings=False, code=False)
    return shared


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """The optimizer's hyperparameters by name (where a --task-arg such as lr= ends up), which every rank must share."""
    groups = group_options(optimizer)
    shared = {"optimizer": f"{type(optimizer).__name__} of {len(groups)} parameter group(s)"}
    for index, group in enumerate(groups):
        shared |= {f"the optimizer's {name} (group {index})": repr(value) for name, value in group.items()}
    return shared


def data_settings(task: Task) -> dict[str, str]:
    """The task's data as every rank can tell it cheaply and alike: each set's length, and a hash of a few of its
    items (``items_digest``). The Trainer gives each rank its share of one set: sets of other lengths would have the
    ranks take different numbers of steps, and a split drawn per rank would validate on what another rank trains on."""
    shared, digests = {}, data_digests(task)
    for name, data in (("train_data", task.train_data), ("val_data", task.val_data)):
        shared[f"the task's {name} (its length)"] = "none" if data is None else repr(data_size(data))
        shared[f"the task's {name} (a hash of a few of its items)"] = digests.get(name, "not read")
    return shared


def data_digests(task: Task) -> dict[str, str]:
    """The ``items_digest`` of the task's train_data and val_data, by name, of each set it reads: of the whole set, the
    same at any world size or micro-batch. The ranks compare them (``data_settings``); a checkpoint keeps them, and a
    resumed run compares its own with those (``Position.check_data``)."""
    sets = {"train_data": task.train_data, "val_data": task.val_data}
    return {name: digest for name, data in sets.items() if data is not None and (digest := items_digest(data))}


def items_digest(data: Any) -> str | None:
    """A short hash of ``data``'s items at four places (the first, the last, two between), where reading them is
    cheap and gives the same items on every read: a TensorDataset, a list or tuple of items, and subsets or
    concatenations of those. Of a subset of another dataset (``random_split`` of an image folder, say) the hash is
    of the indices at those places. None for the rest: a dataset that reads files or augments at random is not read
    here, nor a stream, nor an item of a kind ``_hash_item`` does not read."""
    size = data_size(data)
    if not size or isinstance(data, IterableDataset):
        return None
    places = sorted({0, size // 3, 2 * size // 3, size - 1})
    digest = hashlib.sha256()
    try:
        if _in_memory(data):
            for place in places:
                _hash_item(digest, data[place])
        elif isinstance(data, Subset):
            digest.update(repr([int(data.indices[place]) for place in places]).encode())
        else:
            return None
    except Exception:  # an item of another kind, a failing index: the lengths are compared all the same
        return None
    return digest.hexdigest()[:16]


def _in_memory(data: Any) -> bool:
    """Whether indexing ``data`` reads items held in memory, as they are (no file read, no random draw)."""
    if isinstance(data, Subset):
        return _in_memory(data.dataset)
    if isinstance(data, ConcatDataset):
        return all(_in_memory(part) for part in data.datasets)
    return isinstance(data, TensorDataset | list | tuple)


def _hash_item(digest: Any, item: Any) -> None:
    """Add ``item`` to ``digest``: tensors and arrays by shape, dtype and bytes (wherever the tensor is), numbers and
    texts by value, tuples, lists and dicts by their parts; TypeError for anything else (an object's repr may hold
    its address, another on every rank)."""
    if isinstance(item, torch.Tensor):
        flat = item.detach().cpu().contiguous().reshape(-1)
        digest.update(f"tensor{tuple(item.shape)}{item.dtype}".encode())
        digest.update(flat.view(torch.uint8).numpy())
    elif isinstance(item, np.ndarray) and not item.dtype.hasobject:
        digest.update(f"array{item.shape}{item.dtype}".encode())
        digest.update(np.ascontiguousarray(item).tobytes())
    elif isinstance(item, bool | int | float | complex | str | bytes | np.generic) or item is None:
        digest.update(f"{type(item).__name__}:{item!r}".encode())
    elif isinstance(item, tuple | list):
        digest.update(f"{type(item).__name__}{len(item)}".encode())
        for part in item:
            _hash_item(digest, part)
    elif isinstance(item, Mapping):
        digest.update(f"dict{len(item)}".encode())
        for key, part in item.items():
            _hash_item(digest, key)
            _hash_item(digest, part)
    else:
        raise TypeError(f"{type(item).__name__} is not hashed here")


def check_ranks_agree(config: TrainerConfig, task: Task, model: nn.Module, env: DistEnv) -> None:
    """Refuse, on every rank alike, a job whose ranks differ in a setting of ``settings``, before the model is wrapped
    (DDP's wrap compares the shapes of the parameters with its own raw error). Collective under several processes,
    where every rank calls it; one process has nothing to compare."""
    if env.distributed:
        _refuse_differences(gather_objects(settings(config, task, model) | launch_settings(env)))


def launch_settings(env: DistEnv, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The launcher's flags every machine of a job must share: its count of machines (torchrun's GROUP_WORLD_SIZE,
    from --nnodes), and its hang watchdog's timeouts (a machine without --hang-timeout starts no watchdog, which the
    others' then report as never started)."""
    return {
        "the launcher's --nnodes": environ.get("GROUP_WORLD_SIZE", "1"),
        "the launcher's --hang-timeout": f"{env.hang_timeout_s:g}" if env.hang_timeout_s else "none",
        "the launcher's --hang-start-timeout": f"{env.hang_start_timeout_s:g}" if env.hang_start_timeout_s else "none",
    }


def check_optimizers_agree(optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
    """Refuse, on every rank alike, a job whose optimizers differ (``optimizer_settings``); collective as
    ``check_ranks_agree`` is, once the Runtime has built the optimizer."""
    if env.distributed:
        _refuse_differences(gather_objects(optimizer_settings(optimizer)))


def _refuse_differences(every: list[dict[str, str]]) -> None:
    """Raise the ConfigError for the first setting in which a rank's settings (``every``, in rank order) differ."""
    for name, first in every[0].items():
        other = next((rank for rank, theirs in enumerate(every) if theirs.get(name) != first), None)
        if other is not None:
            data = (
                " and build the same data on each (a split seeded by the rank differs; data drawn at random in the "
                "task's factory needs `redline train --seed N`, which seeds every rank alike before the factory runs, "
                "or, in Python, torch.manual_seed(N) before the Task is built)"
            ) if "data" in name else ""  # fmt: skip
            raise ConfigError(
                f"the ranks of this job were given different settings: {name} is {first} on rank 0 and "
                f"{every[other].get(name)} on rank {other}; they would train apart, or wait for each other until "
                f"the backend's timeout\nhint: start every node with the same arguments (the same flags and "
                f"--task-arg values){data}"
            )
