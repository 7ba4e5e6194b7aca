"""Data order that resumes exactly and splits a global batch across ranks.

``EpochSampler`` fixes the order of every epoch by (seed, epoch) and can start mid-epoch.
``GlobalBatchSampler`` cuts that order into global batches and hands each rank its contiguous
share, so a run's batches, and for models without batch-dependent layers its results, do not
depend on the number of processes.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from redline.errors import ConfigError, invalid
from redline.parallel.collectives import run_on_rank0
from redline.parallel.env import DistEnv
from redline.plan import Choice

T = TypeVar("T")
log = logging.getLogger("redline")
SPLITS_ACROSS_RANKS = "splits_across_ranks"  # a stream's attribute: True where each rank yields its own share


def splits_across_ranks(dataset: Any) -> bool:
    """Whether ``dataset`` says it yields each rank its own share (its class sets ``splits_across_ranks = True``)."""
    return bool(getattr(dataset, SPLITS_ACROSS_RANKS, False))


class EpochSampler(Sampler[int]):
    """Yield a dataset's indices in an order fixed by ``seed`` and the epoch, from any position.

    The permutation of epoch ``e`` comes from a generator seeded with ``seed + e``, so it does not
    depend on anything else the run does with random numbers and is the same on every rank;
    ``set_epoch(e, skip=k)`` starts the epoch after its first ``k`` indices, which is how a
    resumed run continues mid-epoch. With ``auto_epoch`` each new iteration moves to the next epoch
    (for loops that never call set_epoch).
    """

    def __init__(self, size: int, *, shuffle: bool, seed: int, auto_epoch: bool = False) -> None:
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.auto_epoch = auto_epoch
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch = epoch
        self.skip = min(skip, self.size)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        indices = order[self.skip :].tolist()
        if self.auto_epoch:
            self.epoch, self.skip = self.epoch + 1, 0
        return iter(indices)

    def __len__(self) -> int:
        return self.size - self.skip


class GlobalBatchSampler(Sampler[list[int]]):
    """Batches of ``global_batch`` indices, of which this rank takes its contiguous 1/world share.

    A last batch whose size does not split evenly across the ranks is dropped (with one process,
    it is kept): uneven shares would weigh samples differently in the averaged gradient.
    """

    def __init__(
        self, sampler: EpochSampler, *, global_batch: int, rank: int = 0, world_size: int = 1, drop_last: bool = False
    ) -> None:
        check_split(global_batch, world_size)
        self.drop_last = drop_last  # the loader drops it, or a compiled model keeps one batch size (no recompile)
        self.sampler = sampler
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world_size

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.global_batch:
                yield self._share(batch)
                batch = []
        if batch and len(batch) % self.world_size == 0 and not self.drop_last:
            yield self._share(batch)

    def dropped(self) -> int:
        """The samples of a whole pass its last batch leaves out: all of a partial one under drop_last, else one
        that does not split evenly across the ranks."""
        rest = self.sampler.size % self.global_batch
        return rest if self.drop_last or rest % self.world_size else 0

    def _share(self, batch: list[int]) -> list[int]:
        n = len(batch) // self.world_size
        return batch[self.rank * n : (self.rank + 1) * n]

    def __len__(self) -> int:
        return batches_per_epoch(len(self.sampler), self.global_batch, self.world_size, self.drop_last)


def check_split(global_batch: int, world_size: int, *, task: str = "") -> None:
    """Refuse a global batch that does not split evenly across the processes; ``task``: the name of the task whose
    own batch_size it is (none was given), which the message names in place of the option."""
    if global_batch % world_size:
        below = global_batch - global_batch % world_size
        nearest = below if below and global_batch - below < world_size / 2 else below + world_size  # a tie: the larger
        split = f"a multiple of {world_size}: the batch size is the global batch, split across {world_size} processes"
        if task:  # not the option's: a flag's name for it would blame one the user never passed
            raise ConfigError(
                f"task {task!r}'s own batch_size={global_batch} is not allowed under {world_size} processes; expected "
                f"{split}\nhint: pass --batch-size {nearest} (batch_size={nearest}), or the task's own option for it"
            )
        raise invalid("batch_size", global_batch, split, f"e.g. batch_size={nearest}")


def data_size(data: Any) -> int | None:
    """The items one pass of ``data`` holds: a dataset's length, or a stream's where it states one (an
    IterableDataset with ``__len__``, which the DataLoader reads too); None for a stream without."""
    try:
        return len(data)
    except TypeError:  # no __len__, or one that refuses (a stream of unknown length)
        return None


def batches_per_epoch(size: int, global_batch: int, world_size: int = 1, drop_last: bool = False) -> int:
    """Return the number of global batches in ``size`` samples, counting a last one that splits evenly
    (unless ``drop_last``)."""
    full, rest = divmod(size, global_batch)
    return full + (1 if rest and rest % world_size == 0 and not drop_last else 0)


def is_stream(dataset: Dataset[Any]) -> bool:
    """Whether ``dataset`` is read as a stream: an IterableDataset, or anything without a length."""
    return isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__")


def reads_apart(dataset: Dataset[Any], world_size: int) -> bool:
    """Whether each of ``world_size`` ranks reads its own share of ``dataset``: a stream that says it yields one
    (``splits_across_ranks = True``), whose ``__len__``, if it has one, is then that share's."""
    return world_size > 1 and is_stream(dataset) and splits_across_ranks(dataset)


def job_size(dataset: Dataset[Any], world_size: int) -> int | None:
    """The items one pass of ``dataset`` holds over the job's ``world_size`` ranks (None for a stream without a
    length): a stream read apart states one rank's share, the same on every rank."""
    size = data_size(dataset)
    return size * world_size if size is not None and reads_apart(dataset, world_size) else size


def untrained_batches(per_epoch: int, *, grad_accum: int, max_epochs: float, max_steps: int | None) -> int:
    """The batches at a run's end that complete no optimizer step of ``grad_accum`` (the Runtime counts them across
    an epoch's end): the last of its epochs' batches, where the epochs end the run (not ``max_steps``)."""
    if math.isinf(max_epochs):
        return 0
    batches = int(max_epochs * per_epoch)
    return batches % grad_accum if batches // grad_accum <= (max_steps or math.inf) else 0


def split_caveats(model: nn.Module, world_size: int) -> list[str]:
    """Say which of ``model``'s layers make its results depend on how the global batch is split.

    BatchNorm normalises over the samples of one rank, not the global batch (``nn.SyncBatchNorm``
    would make them global); dropout draws its masks from each rank's own random stream. One
    process splits nothing, so it has no caveat.
    """
    if world_size <= 1:
        return []
    caveats = []
    norms = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
                for m in model.modules())  # fmt: skip
    if norms:
        caveats.append(
            f"{norms} BatchNorm layer(s) use each rank's share of the batch for their statistics, so results differ "
            "from one process (torch.nn.SyncBatchNorm.convert_sync_batchnorm makes them global)"
        )
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        caveats.append("dropout draws from each rank's own random stream, so its masks differ from one process")
    return caveats


def global_batches(loader: Iterable[Any], env: DistEnv, *, seed: int | None) -> GlobalBatchSampler | None:
    """Under several processes, a batch sampler that gives this rank its share of each global batch of ``loader``.

    None for one process, an iterable of batches, the user's own batch sampler, a loader already split, or a
    DataLoader subclass (kept as given).
    Without a ``seed``, a shuffled order's is drawn on rank 0 as a plain shuffling DataLoader draws its own
    (from its generator, else torch's, which ``torch.manual_seed`` fixes) and shared by every rank.
    """
    if not env.distributed:
        return None
    if isinstance(loader, DataLoader) and isinstance(loader.batch_sampler, GlobalBatchSampler):
        return None  # the Trainer's loader is split already
    if not isinstance(loader, DataLoader) or loader.batch_size is None:  # an iterable of batches, or its own sampler
        if env.rank == 0:
            what = "a DataLoader with a batch_sampler" if isinstance(loader, DataLoader) else "an iterable of batches"
            log.warning(
                "setup_loader keeps %s as it is: each of the %d processes reads every batch it gives, unless it gives "
                "each rank its own share already\nhint: pass a DataLoader with batch_size (and a sampler, or shuffle), "
                "which setup_loader splits across the ranks, or a DistributedSampler of your own", what, env.world_size,
            )  # fmt: skip
        return None
    if isinstance(loader.dataset, IterableDataset):  # a stream has no indices to split: it must split itself
        if env.rank == 0 and not splits_across_ranks(loader.dataset):
            log.warning(
                "setup_loader keeps a DataLoader over an IterableDataset (%s) as it is: each of the %d processes reads "
                "the whole stream\nhint: have its __iter__ yield this rank's share (every "
                "get_world_size()-th item from the get_rank()-th, torch.distributed's) and set the class attribute "
                "%s = True to say it does, or pass a dataset with __len__ and __getitem__, which setup_loader splits",
                type(loader.dataset).__name__, env.world_size, SPLITS_ACROSS_RANKS,
            )  # fmt: skip
        return None
    if isinstance(loader.sampler, DistributedSampler):
        return None  # the user's own split: each rank reads the share it gives, batch_size samples at a time
    if type(loader) is not DataLoader:  # rebuilt to take this rank's share, it would lose its own __iter__
        _warn_kept_whole(loader, env)
        return None
    check_whole_order(loader.sampler, env.world_size)
    key = (seed, env.rank, env.world_size)
    split = _SPLITS.get(loader)
    if split is not None and split[0] == key:  # set up again (each epoch, say): its epochs go on, each shuffled anew
        return split[1]
    shuffle = isinstance(loader.sampler, RandomSampler)
    if seed is None:  # a collective: every rank sets its loader up
        seed = run_on_rank0(lambda: _drawn_seed(loader), "drawing the data order's seed") if shuffle else 0
    order = EpochSampler(
        len(loader.dataset),  # type: ignore[arg-type]
        shuffle=shuffle,
        seed=seed,  # the same order on every rank
        auto_epoch=True,
    )
    batches = GlobalBatchSampler(
        order, global_batch=loader.batch_size, rank=env.rank, world_size=env.world_size, drop_last=loader.drop_last
    )
    _SPLITS[loader] = (key, batches)
    if env.rank == 0 and (dropped := batches.dropped()) and not loader.drop_last:  # drop_last asks for it
        log.warning(
            "setup_loader: the last batch of each pass, %d of the %d samples, does not split evenly across the %d "
            "processes and is left out (a rank's share must be equal: an evaluation then covers %d samples)\nhint: "
            "a batch_size or a dataset length that leaves a multiple of %d at the end keeps every sample",
            dropped, batches.sampler.size, env.world_size, batches.sampler.size - dropped, env.world_size,
        )  # fmt: skip
    return batches


def _warn_kept_whole(loader: DataLoader[Any], env: DistEnv) -> None:
    """Warn (on rank 0) that every rank reads every batch of a DataLoader subclass: setup_loader keeps it as given."""
    if env.rank == 0:
        log.warning(
            "setup_loader keeps %s, a DataLoader subclass, as given: each of the %d processes reads every batch it "
            "gives\nhint: give it a DistributedSampler of your own, or pass a plain DataLoader, which setup_loader "
            "splits across the ranks", type(loader).__name__, env.world_size,
        )  # fmt: skip


def split_reason(
    chosen: Choice[T], loader: Iterable[Any], caveats: list[str], env: DistEnv, grad_accum: int = 1
) -> Choice[T]:
    """The loader axis with how a launched job's global batch is split over its ranks, and the model's layers that
    depend on that split (``caveats``); under several processes, a loader kept whole says that every rank reads it.
    With ``grad_accum`` micro-batches a step, the global batch is the step's, that many of the loader's batches."""
    if not (isinstance(loader, DataLoader) and isinstance(loader.batch_sampler, GlobalBatchSampler)):
        unsplit = _unsplit(loader) if env.distributed else ""  # one process reads each batch once
        return Choice(chosen.value, f"{chosen.reason}; {unsplit}") if unsplit else chosen
    split = loader.batch_sampler
    parts = f"{split.world_size} x {split.local_batch}"
    if grad_accum > 1:  # the loader's batch of 8 was "global batch 8" where a step trains on 2 of them
        parts = f"{grad_accum} micro-batches x {parts}"
    reason = f"{chosen.reason}; global batch {split.global_batch * grad_accum} = {parts}"
    if split.drop_last:
        reason += "; a partial last batch is dropped (drop_last), so every batch holds the same number of samples"
    elif dropped := split.dropped():
        reason += f"; the last {dropped} samples do not split across the {split.world_size} processes: left out"
    return Choice(chosen.value, "; ".join([reason, *caveats]))


def _unsplit(loader: Iterable[Any]) -> str:
    """What a loader setup_loader keeps whole gives each rank ("" where the loader splits itself)."""
    if not isinstance(loader, DataLoader):
        return "not split: every rank reads every batch of the iterable"
    if isinstance(loader.dataset, IterableDataset):
        if splits_across_ranks(loader.dataset):
            return ""
        return f"not split: every rank reads the whole stream ({SPLITS_ACROSS_RANKS} unset)"
    if isinstance(loader.sampler, DistributedSampler):
        return ""
    if type(loader) is not DataLoader:
        return f"not split: every rank reads every batch of {type(loader).__name__}, a DataLoader subclass"
    if loader.batch_size is not None:
        return ""
    return "not split: every rank reads every batch of the batch_sampler"


def _drawn_seed(loader: DataLoader[Any]) -> int:
    """A seed drawn as a shuffling DataLoader draws its order's: from its sampler's or its generator, else torch's."""
    generator = getattr(loader.sampler, "generator", None) or loader.generator
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


# The split of each loader set up under several processes, by the loader: a loop that sets the same loader up
# every epoch gets the same split, whose order moves on to the next epoch, and not epoch 0's order every time.
_SPLITS: weakref.WeakKeyDictionary[DataLoader[Any], tuple[tuple[int | None, int, int], GlobalBatchSampler]] = (
    weakref.WeakKeyDictionary()
)


def check_whole_order(sampler: Iterable[Any], world_size: int) -> None:
    """Refuse a sampler whose order the split cannot reproduce: it draws every sample once an epoch, in order or
    shuffled (torch's SequentialSampler, RandomSampler without replacement), and nothing else."""
    if type(sampler) is SequentialSampler:
        return
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        return
    name = type(sampler).__name__
    raise ConfigError(
        f"setup_loader splits each batch of the loader over the {world_size} processes in an order of its own, every "
        f"sample once an epoch (shuffled where the loader shuffles), and would drop the loader's sampler ({name}): "
        "its weights, subset or draws with replacement would be lost\nhint: give each process its share yourself "
        "with a DistributedSampler (torch's, or a subclass of yours over your weights or subset), which setup_loader "
        "keeps as it is; for a subset, a torch.utils.data.Subset with shuffle=True is split as any dataset"
    )
