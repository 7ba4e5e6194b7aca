"""The Trainer's data loaders: an exactly resumable training order, and an in-order evaluation.

A map-style dataset is shuffled by epoch; a streaming one (an ``IterableDataset``) is read in its
own order, each rank taking its share of every global batch (or reading its own share, where the
stream says it yields one: ``splits_across_ranks``), and a resumed run skips what the interrupted
one consumed.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from redline.errors import ConfigError, TaskError
from redline.parallel.env import DistEnv
from redline.plan import Choice
from redline.runtime.loading import gathered
from redline.runtime.sampling import (
    EpochSampler,
    GlobalBatchSampler,
    batches_per_epoch,
    check_split,
    data_size,
    is_stream,
    job_size,
    reads_apart,
    splits_across_ranks,
    untrained_batches,
)
from redline.task import CollateFn

log = logging.getLogger("redline")


_END = object()


class StreamShard(IterableDataset[Any]):
    """A stream's items, cut into global batches of which this rank takes its contiguous share.

    ``set_epoch(e, skip=k)`` restarts the stream (passing the epoch on to a dataset that has
    ``set_epoch``) and drops its first ``k`` items: how a resumed run continues where it stopped.
    A last global batch that does not split evenly across the ranks is dropped, as in a map-style run.
    A stream that yields each rank its own share (``reads_apart``) is cut into this rank's batches as it
    comes, and skips its share of the ``k`` items. One loader worker at most reads it (``worker_limit``).
    """

    splits_across_ranks = True  # each rank yields its own share of every global batch

    def __init__(
        self, dataset: Dataset[Any], *, global_batch: int, rank: int = 0, world_size: int = 1, drop_last: bool = False
    ) -> None:
        check_split(global_batch, world_size)
        self.drop_last = drop_last
        self.dataset = dataset
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.skip = 0
        self._said_longer = False
        # Cut what this rank reads into batches of `read` items, of which it takes part `part` of `parts`:
        # a whole global batch shared by every rank, or this rank's own share of one.
        apart = reads_apart(dataset, world_size)
        self.parts, self.part = (1, 0) if apart else (world_size, rank)
        self.read = global_batch // world_size if apart else global_batch

    @property
    def worker_limit(self) -> int:
        """One loader worker: the global batches are cut in the stream's own order, which one reader sees whole."""
        return 1

    @property
    def limit_reason(self) -> str:
        return (
            f"train_data ({type(self.dataset).__name__}) is a stream, cut into global batches in its own order so "
            "that a resumed run goes on exactly: one worker reads it whole, where each of N would run its __iter__ "
            "and yield all of it, or only its share where it splits itself by get_worker_info()"
        )

    def _pass(self, length: int | None) -> Iterator[Any]:
        """One pass of the stream, cut at its ``__len__`` (said once where it had more to give)."""
        stream = iter(self.dataset)
        if length is None:
            yield from stream
            return
        yield from itertools.islice(stream, length)
        if not self._said_longer and next(stream, _END) is not _END:
            self._said_longer = True
            _more_than_said(self.dataset, length)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.skip = skip * self.read // self.global_batch  # the job's items, or this rank's share of them
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        share = self.read // self.parts
        length = data_size(self.dataset)  # the run planned its epochs by it: a pass ends there
        items = itertools.islice(self._pass(length), self.skip, None)
        while batch := list(itertools.islice(items, self.read)):
            if len(batch) % self.parts or (self.drop_last and len(batch) < self.read):
                return
            n = len(batch) // self.parts if len(batch) < self.read else share
            yield from batch[self.part * n : (self.part + 1) * n]


def _more_than_said(dataset: Dataset[Any], length: int) -> None:
    log.warning(
        "train_data (%s) yields more items in one pass than its __len__ says (%d): an epoch takes the first %d, as "
        "the run was planned by them\nhint: make __len__ return the items one pass yields", type(dataset).__name__,
        length, length,
    )  # fmt: skip


def plan_length(
    data: Dataset[Any],
    *,
    batch_size: int,
    world_size: int,
    grad_accum: int,
    max_epochs: float,
    max_steps: int | None,
    drop_last: bool = False,
    warn: bool = True,
) -> tuple[float, int | None]:
    """Return a run's optimizer steps, and its batches per epoch (None for a stream whose length is unknown).

    The epochs' steps are cut at ``max_steps``; a stream without ``__len__`` needs ``max_steps``, and one with
    it plans its epochs by that length, as torch's DataLoader reports it (one rank's, where each reads its own).
    ``warn``: say what the run leaves out (rank 0's call says it; a count taken beside it, none).
    """
    size = job_size(data, world_size)
    if size is None:
        if max_steps is None:
            raise ConfigError(
                f"train_data is a stream ({type(data).__name__} has no length), so an epoch's end cannot be "
                "planned\nhint: pass --max-steps N (max_steps=N); a stream that runs dry starts again as the next "
                "epoch; or give it __len__ (the items one pass yields)"
            )
        return max_steps, None
    per_epoch = batches_per_epoch(size, batch_size, world_size, drop_last)
    if not per_epoch:
        found = "is empty" if not size else f"holds {size} item(s), not one batch of {batch_size}"
        split = f" split across {world_size} processes" if world_size > 1 else ""
        raise TaskError(
            f"train_data {found}{split}: there is nothing to train on\n"
            "hint: check the dataset's length, or lower the batch size"
        )
    if size < batch_size and not drop_last and warn:  # one partial batch an epoch: each step sees the whole set
        log.warning(
            "train_data holds %d items, fewer than a batch of %d: every batch is the whole set of %d\nhint: pass "
            "--batch-size %d to say so, or --grad-accum N for more samples per step", size, batch_size, size, size
        )  # fmt: skip
    if grad_accum > per_epoch and not drop_last and warn:  # said once: the first count (a compiled run counts again)
        log.warning(
            "grad_accum=%d takes %d batches for each optimizer step, and an epoch of train_data holds %d: each step "
            "spans %.3g epochs, its gradient taken over the same samples that many times\nhint: lower --grad-accum "
            "to %d or less (one epoch a step)", grad_accum, grad_accum, per_epoch, grad_accum / per_epoch, per_epoch,
        )  # fmt: skip
    # The Runtime counts micro-batches across an epoch's end, so the epochs' steps are their batches over grad_accum
    steps = math.inf if math.isinf(max_epochs) else int(max_epochs * per_epoch) // grad_accum
    if not steps:
        raise ConfigError(
            f"grad_accum={grad_accum} needs {grad_accum} batches for one optimizer step, and {max_epochs:g} epoch(s) "
            f"of {per_epoch} batch(es) hold {int(max_epochs * per_epoch)}: the run would never step\n"
            "hint: lower --grad-accum or the batch size, or train more epochs"
        )
    batches = int(max_epochs * per_epoch) if math.isfinite(steps) else 0
    left = untrained_batches(per_epoch, grad_accum=grad_accum, max_epochs=max_epochs, max_steps=max_steps)
    if left and not drop_last and warn:  # the epochs end the run, its last batches in no step
        log.warning(
            "grad_accum=%d: the run's %d batches (%g epoch(s) of %d) make %d optimizer steps, and its last %d "
            "batch(es) complete none, so they are not trained on\nhint: pass a --grad-accum that divides %d, or a "
            "--batch-size or --epochs that makes the batches a multiple of it",
            grad_accum, batches, max_epochs, per_epoch, steps, left, batches,
        )  # fmt: skip
    return min(steps, max_steps or math.inf), per_epoch


def no_batch(epoch: int, world_size: int) -> TaskError:
    """The error for a stream that gave no batch in ``epoch`` (from 0): empty, used up, or too short to share."""
    short = f", or it holds fewer items than the {world_size} processes share" if world_size > 1 else ""
    if epoch == 0:
        return TaskError(
            f"train_data gave no batch in epoch 1: the stream is empty{short}\nhint: check how train_data is built"
        )
    return TaskError(
        f"train_data gave no batch in epoch {epoch + 1}, after batches in the epoch(s) before: its __iter__ gave "
        f"nothing this time, as one that returns the same iterator each time does once it is used up{short}\n"
        "hint: make train_data's __iter__ start a fresh pass each time it is called (write it as a generator, with "
        "yield): a stream that runs dry starts again as the next epoch"
    )


def fixed_shapes(
    data: Any, batch_size: int, env: DistEnv, *, compiled: Choice[bool] | None, model: torch.nn.Module
) -> bool:
    """Whether to drop a partial last batch: a model ``compiled`` (the Plan's field) given one would compile again
    for its shape, and a batch norm cannot train on a last batch of one sample a process (said on rank 0). Not where
    a stream has no length, nor where every batch is partial (fewer items than one)."""
    size = job_size(data, env.world_size)
    if size is None or not batches_per_epoch(size, batch_size, env.world_size, drop_last=True):
        return False
    if compiled is not None and compiled.value:
        return True
    left = size % batch_size  # the last global batch, split across the processes (or dropped where it cannot be)
    if left != env.world_size or not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return False
    if env.is_main:
        log.warning(
            "train_data's %d items leave a last batch of %d per epoch, one sample a process, on which the model's "
            "batch norm cannot train: it is left out of each epoch\nhint: a batch size that leaves no remainder of "
            "one keeps every sample", size, left,
        )  # fmt: skip
    return True


def train_loader(
    dataset: Dataset[Any],
    *,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    collate_fn: CollateFn | None = None,
    start_step: int = 0,
) -> tuple[DataLoader[Any], EpochSampler | StreamShard]:
    """Return a DataLoader over ``dataset`` (this rank's share of each global batch) and what sets its epoch.

    A map-style dataset is shuffled by (seed, epoch); a stream keeps its own order (one that yields each rank its
    own share is batched as it comes). With ``drop_last`` a partial last batch is left out (a compiled model then
    keeps one shape). Loader workers are seeded by (seed, ``start_step``, the step the run starts at).
    """
    # A DataLoader draws its workers' base seed from this generator, not from torch's global RNG,
    # so starting an epoch (or a resumed one) leaves the model's random stream (dropout) untouched.
    generator = torch.Generator().manual_seed(worker_seed(seed, start_step))
    if is_stream(dataset):
        stream = StreamShard(dataset, global_batch=batch_size, rank=rank, world_size=world_size, drop_last=drop_last)
        loader = DataLoader(stream, batch_size=batch_size // world_size, generator=generator, collate_fn=collate_fn)
        return loader, stream
    sampler = EpochSampler(len(dataset), shuffle=True, seed=seed)  # type: ignore[arg-type]
    batches = GlobalBatchSampler(
        sampler, global_batch=batch_size, rank=rank, world_size=world_size, drop_last=drop_last
    )
    return DataLoader(dataset, batch_sampler=batches, generator=generator, collate_fn=collate_fn), sampler


def worker_seed(seed: int, start_step: int) -> int:
    """The seed of a run's loader workers' random streams (numpy, random and torch in each worker): ``seed`` for a
    run from its start, so its workers draw as they always did; another for a run resumed at ``start_step``, whose
    workers would otherwise replay the first epoch's draws (its augmentations) over the samples left. Workers resumed
    mid-epoch cannot draw what the unbroken run's drew: their positions in the streams were not saved."""
    return (seed + start_step * 0x9E3779B97F4A7C15) % 2**64  # the golden-ratio step of splitmix64: seeds far apart


def eval_loader(
    dataset: Dataset[Any],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    collate_fn: CollateFn | None = None,
) -> DataLoader[Any]:
    """Return an in-order DataLoader over this rank's shard: every sample is seen exactly once.

    A map-style dataset is cut into contiguous shards; a stream is dealt out item by item, unless it yields each
    rank its own share (``splits_across_ranks``), which is read as it comes.
    """
    if world_size > 1 and is_stream(dataset):
        if not splits_across_ranks(dataset):  # one that yields each rank its own share is read as it comes
            dataset = _EveryNth(dataset, start=rank, step=world_size)
    elif world_size > 1:
        size = len(dataset)  # type: ignore[arg-type]
        start, stop = size * rank // world_size, size * (rank + 1) // world_size
        dataset = Subset(dataset, range(start, stop))
    dataset, collate_fn = gathered(dataset, collate_fn)  # in-memory tensors: each batch indexed out at once
    return DataLoader(dataset, batch_size=batch_size, generator=torch.Generator().manual_seed(0), collate_fn=collate_fn)


class _EveryNth(IterableDataset[Any]):
    """Every ``step``-th item of a stream from ``start``: one rank's share, with no item dropped or repeated."""

    def __init__(self, dataset: Dataset[Any], *, start: int, step: int) -> None:
        self.dataset, self.start, self.step = dataset, start, step

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.dataset), self.start, None, self.step)
