"""Data loading: DataLoader tuning and device loaders that overlap the copy with compute."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    Subset,
    TensorDataset,
    default_collate,
)

from redline.errors import RedlineError, invalid
from redline.hardware.device import DeviceFacts
from redline.parallel.env import DistEnv
from redline.plan import Choice
from redline.plan.loader import LoaderFacts, LoaderSettings, resolve_loader
from redline.runtime.contract import users_failure
from redline.runtime.sampling import EpochSampler, GlobalBatchSampler
from redline.runtime.transfer import move_batch, tensors_in

log = logging.getLogger("redline")


def loader_facts(loader: Iterable[Any], local_devices: int = 1) -> LoaderFacts:
    """Read what the loader resolver needs from a loader (a DataLoader or any iterable of batches).

    A map-style dataset is refused: iterated, it gives its samples one by one, not batches.
    """
    if isinstance(loader, Dataset) and not isinstance(loader, IterableDataset):
        raise invalid(
            "setup_loader(loader)",
            type(loader).__name__,
            "a DataLoader or another iterable of batches; a dataset gives its samples one at a time, unbatched",
            "wrap it: rt.setup_loader(DataLoader(dataset, batch_size=64, shuffle=True))",
        )
    iterable = isinstance(loader, Iterable) or hasattr(type(loader), "__getitem__")  # iter() takes either
    if isinstance(loader, torch.Tensor) or not iterable:  # a tensor iterates its rows, unbatched
        raise invalid(
            "setup_loader(loader)",
            type(loader).__name__,
            "a DataLoader or another iterable of batches (a list of (inputs, targets) pairs, a generator)",
            "wrap tensors: rt.setup_loader(DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True))",
        )
    if not isinstance(loader, DataLoader):
        return LoaderFacts(is_dataloader=False, map_style=False, in_memory=False, num_workers=0, pin_memory=False)
    dataset = loader.dataset
    subclass = "" if type(loader) is DataLoader else type(loader).__name__  # rebuilt, it would lose its own code
    return LoaderFacts(
        is_dataloader=True,
        map_style=not isinstance(dataset, IterableDataset),
        in_memory=_in_memory(dataset),
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        local_devices=local_devices,
        gatherable=not subclass and loader.batch_sampler is not None and can_gather(dataset, loader.collate_fn),
        persistent_workers=loader.persistent_workers,
        prefetch_factor=loader.prefetch_factor,
        worker_limit=limit if isinstance(limit := getattr(dataset, "worker_limit", None), int) else None,
        limit_reason=str(getattr(dataset, "limit_reason", "")),
        subclass=subclass,
    )


def plan_loader(
    loader: Iterable[Any], facts: DeviceFacts, env: DistEnv, local_devices: int | None, *, workers: int | None
) -> Choice[LoaderSettings]:
    """The loader axis for ``loader``: ``workers`` as asked for, or by ``facts``' cores shared among
    ``local_devices`` processes (by default the launch's processes on this machine, ``env.local_world_size``)."""
    devices = env.local_world_size if local_devices is None else local_devices
    return resolve_loader(loader_facts(loader, devices), facts, workers=workers)


def tuned_dataloader(
    loader: Iterable[Any], settings: LoaderSettings, batches: Sampler[list[int]] | None, *, workers: int | None
) -> Iterable[Any]:
    """Return ``loader`` with ``settings`` applied: a DataLoader rebuilt where they differ from its own, or where
    ``batches`` gives this rank its share. A DataLoader subclass is kept as given (rebuilt, it would lose its own
    ``__iter__`` and methods), and loader ``workers`` asked for that it does not run are warned of."""
    if not isinstance(loader, DataLoader):
        return loader
    if type(loader) is not DataLoader:
        if workers is not None and workers != loader.num_workers:
            log.warning(
                "loader_workers=%d is not applied to %s: a DataLoader subclass is kept as given (its own "
                "num_workers=%d runs), since a plain DataLoader rebuilt from it would lose its own __iter__ and "
                "methods\nhint: set num_workers on %s yourself, or pass a plain DataLoader (with the subclass's work "
                "done in its dataset or collate_fn)", workers, type(loader).__name__, loader.num_workers,
                type(loader).__name__,
            )  # fmt: skip
        return loader
    if settings.rebuild or batches is not None:
        return rebuild_dataloader(loader, settings, batch_sampler=batches)
    return loader


def _in_memory(dataset: Any) -> bool:
    # A Subset (and the gathering twin) hands on the items of the dataset it holds in .dataset; a user's class
    # with a .dataset may do work of its own per item (augmenting, decoding), which workers would take on.
    while isinstance(dataset, Subset | GatheredTensors):
        dataset = dataset.dataset
    return isinstance(dataset, TensorDataset)


def rebuild_dataloader(
    loader: DataLoader[Any], settings: LoaderSettings, *, batch_sampler: Sampler[list[int]] | None = None
) -> DataLoader[Any]:
    """Return a DataLoader over the same data, sampler and collation, with ``settings`` applied.

    The order is the same in the first epoch. With persistent workers torch draws no new worker
    seed from the generator in later epochs, so a seeded shuffle stays deterministic but departs
    from the order the untuned loader would have given.
    """
    dataset, collate = (
        gathered(loader.dataset, loader.collate_fn) if settings.gather else (loader.dataset, loader.collate_fn)
    )
    common: dict[str, Any] = {
        "num_workers": settings.num_workers,
        "collate_fn": collate,
        "pin_memory": settings.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": settings.persistent_workers and settings.num_workers > 0,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": loader.in_order,  # False: a batch as soon as any worker has it
    }
    if settings.num_workers > 0 and settings.prefetch_factor is not None:
        common["prefetch_factor"] = settings.prefetch_factor
    if batch_sampler is not None:  # a new order, such as this rank's share of each global batch
        return DataLoader(dataset, batch_sampler=batch_sampler, **common)
    if isinstance(dataset, IterableDataset):
        if settings.num_workers > 1 and settings.num_workers != loader.num_workers:
            _warn_unsplit(dataset, settings.num_workers)
        return DataLoader(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **common)
    if loader.batch_size is not None:
        # The same sampler object: the user's shuffling, generator and position carry over.
        return DataLoader(
            dataset, batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last, **common
        )
    if loader.batch_sampler is not None:  # the user's own batch sampler
        return DataLoader(dataset, batch_sampler=loader.batch_sampler, **common)
    return DataLoader(dataset, batch_size=None, sampler=loader.sampler, **common)  # single items


SPLITS_ACROSS_WORKERS = "splits_across_workers"  # a stream's attribute: True where each worker yields its own share


def _warn_unsplit(dataset: IterableDataset[Any], workers: int) -> None:
    """Warn that ``workers`` processes (asked for, not the loader's own) each run a stream's ``__iter__`` in full:
    unless it splits itself by ``get_worker_info()``, as torch leaves streams to do, every sample comes N times."""
    if getattr(dataset, SPLITS_ACROSS_WORKERS, False):
        return
    log.warning(
        "%d loader workers over %s, an IterableDataset: each worker runs its __iter__ in full, so a stream that does "
        "not split itself by torch.utils.data.get_worker_info() yields every sample %d times (set the class "
        "attribute %s = True on one that does, to say so)", workers, type(dataset).__name__, workers,
        SPLITS_ACROSS_WORKERS,
    )  # fmt: skip


class GatheredTensors(Dataset[Any]):
    """A TensorDataset whose batches are indexed out of its tensors at once: DataLoader hands ``__getitems__``
    a batch's indices, so a batch of 64 costs one index per tensor instead of 64 and a stack (the same values)."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.dataset = dataset  # named as Subset's is: what wraps a dataset holds it in .dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = _in_range(torch.as_tensor(indices, dtype=torch.long), len(self))
        # On one thread: split over the process's threads, a copy this small waits for a busy core (an epoch of
        # 3x32x32 images took 0.2-1.2 s on 2 threads of a loaded machine, 46 ms on one; DataLoader's stack, 100 ms).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return [torch.index_select(tensor, 0, index) for tensor in self.dataset.tensors]
        finally:
            torch.set_num_threads(threads)


def _in_range(index: torch.Tensor, size: int) -> torch.Tensor:
    """``index`` with negative indices counted from the end, as TensorDataset's ``dataset[-1]`` takes them (where
    index_select refuses them); one out of range is refused with the IndexError that indexing a tensor gives."""
    if not index.numel() or (int(index.min()) >= 0 and int(index.max()) < size):
        return index
    outside = index[(index < -size) | (index >= size)]
    if outside.numel():
        raise IndexError(f"index {int(outside[0])} is out of bounds for dimension 0 with size {size}")
    return torch.where(index < 0, index + size, index)


def can_gather(dataset: Any, collate_fn: Any) -> bool:
    """Whether batches of ``dataset`` can be gathered whole: a TensorDataset (a subclass may index its own way)
    under the default collation (None or default_collate; a user's own collate_fn is left to collate)."""
    return type(dataset) is TensorDataset and collate_fn in (None, default_collate)


def gathered(dataset: Any, collate_fn: Any) -> tuple[Any, Any]:
    """``dataset`` and ``collate_fn`` as a DataLoader should take them: gathered whole where ``can_gather``,
    anything else as it is."""
    if can_gather(dataset, collate_fn):
        return GatheredTensors(dataset), _gathered
    return dataset, collate_fn


def _gathered(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The collation of a GatheredTensors batch: already whole (a list of tensors, as default_collate gives)."""
    return batch


class DeviceLoader:
    """Iterate a loader with each batch already on the device.

    On CUDA the next batch is copied on a side stream while the current step computes; the
    compute stream waits for that copy before it reads the batch.
    """

    def __init__(
        self, loader: Iterable[Any], device: torch.device, *, channels_last: bool = False, whole: bool = True
    ) -> None:
        self.loader = loader
        self.device = device
        self.channels_last = channels_last
        self.whole = whole  # with channels_last, a batch other than an (inputs, targets) pair is laid out too

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Have the next pass read epoch ``epoch``'s order, as a DistributedSampler's ``set_epoch``: what a loop resumed
        under several processes calls before each epoch, so its order goes on where it left off (each pass moves on
        by itself from there). With one process it does nothing: a plain loader draws its order from torch's random
        stream, which ``rt.load`` restores."""
        split = getattr(self.loader, "batch_sampler", None)
        order = split.sampler if isinstance(split, GlobalBatchSampler) else getattr(self.loader, "sampler", None)
        if isinstance(order, EpochSampler | DistributedSampler):  # the split's order, or the user's own split
            order.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.device.type == "cuda":
            return self._prefetch_cuda()
        if self.device.type == "cpu":
            return self._laid_out(read_batches(self.loader))
        return (self._move(b) for b in read_batches(self.loader))

    def _laid_out(self, batches: Iterator[Any]) -> Iterator[Any]:
        """CPU batches as they come, their 4-d tensors laid out NHWC while ``channels_last`` (which a run's precision
        check may change between two batches: runtime/layout.py)."""
        for batch in batches:
            yield self._move(batch) if self.channels_last else batch

    def _move(self, batch: Any, *, non_blocking: bool = False) -> Any:
        laid, whole = self.channels_last, self.whole
        return move_batch(batch, self.device, non_blocking=non_blocking, channels_last=laid, whole=whole)

    def __getattr__(self, name: str) -> Any:
        # Reach through to the loader for .dataset, .sampler, .batch_size and friends.
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _prefetch_cuda(self) -> Iterator[Any]:
        stream = torch.cuda.Stream(self.device)

        def copy(batch: Any) -> tuple[Any, bool]:
            with torch.cuda.stream(stream):
                laid = self.channels_last
                return self._move(batch, non_blocking=True), laid

        source = read_batches(self.loader)
        try:
            ready = copy(next(source))
        except StopIteration:
            return
        while True:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)
            for tensor in tensors_in(ready[0]):
                # Memory allocated on the side stream is used on the compute stream.
                tensor.record_stream(current)
            batch, laid = ready
            if self.channels_last and not laid:  # copied before the model was laid out NHWC: as the next ones come
                batch = self._move(batch)
            try:
                ready = copy(next(source))
            except StopIteration:
                yield batch
                return
            yield batch


def read_batches(loader: Iterable[Any], hint: str = "") -> Iterator[Any]:
    """Yield ``loader``'s batches; an exception from the user's dataset or collate_fn is a TrainingError showing
    their line, as one from the model is (redline's own errors, and an out-of-memory, pass as they are). ``hint``
    is its hint, where the caller knows better than the general one."""
    source = iter(loader)
    while True:
        try:
            with users_failure("reading a batch of the data", hint or READ_HINT):
                try:
                    batch = next(source)
                except StopIteration:
                    return
        except RedlineError:
            _stop_workers(loader, source)
            raise
        yield batch


def _stop_workers(loader: Iterable[Any], source: Iterator[Any]) -> None:
    """Stop the worker processes of ``loader``'s pass ``source``, which a failure ended, and have a DataLoader that
    keeps persistent ones start new ones at its next pass.

    The error's traceback holds the pass: its workers would live on, each with its copy of the dataset, until
    Python's garbage collector freed the error (an interactive session keeps the last one), and torch stopping them
    from there waits 5 s a worker, stalling whatever the process was doing at that moment. A DataLoader would iterate
    stopped persistent workers again, and fail on their closed queues.
    """
    shutdown = getattr(source, "_shutdown_workers", None)  # a pass with worker processes (torch's own name)
    if shutdown is None:
        return
    shutdown()
    if isinstance(loader, DataLoader) and loader._iterator is source:
        loader._iterator = None


READ_HINT = (
    "fix your dataset (its __getitem__ or __iter__) or the batch's collate_fn (the DataLoader's, or the Task's: "
    "Task(collate_fn=...) pads items of different lengths); REDLINE_TRACEBACK=1 prints the whole traceback, a "
    "DataLoader worker's included (in Python it is the error's __cause__)"
)
