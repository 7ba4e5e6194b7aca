"""Data-loading axis: worker processes, pinned memory and prefetching."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from redline.errors import invalid
from redline.hardware.device import DeviceFacts
from redline.plan import Choice


@dataclass(frozen=True, kw_only=True)
class LoaderFacts:
    """What the resolver needs to know about the user's data loader."""

    is_dataloader: bool
    map_style: bool
    in_memory: bool  # items are slices of tensors already in memory (TensorDataset)
    num_workers: int
    pin_memory: bool
    local_devices: int = 1  # devices sharing this machine's cores
    gatherable: bool = False  # batches of a TensorDataset under the default collation: one index per tensor
    persistent_workers: bool = False  # as the user set them: a kept loader keeps them
    prefetch_factor: int | None = None
    worker_limit: int | None = None  # the most workers the data can be read by without losing its order
    limit_reason: str = ""
    subclass: str = ""  # the class of a DataLoader subclass: kept as given, its own __iter__ and methods with it


@dataclass(frozen=True, kw_only=True)
class LoaderSettings:
    """How a DataLoader should be configured; ``rebuild`` says whether it differs from the user's."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    rebuild: bool
    gather: bool = False  # each batch indexed out of the tensors at once, not stacked from its samples

    def __str__(self) -> str:
        text = f"workers={self.num_workers} pin_memory={'on' if self.pin_memory else 'off'}"
        if self.num_workers:
            text += f" persistent={'on' if self.persistent_workers else 'off'} prefetch={self.prefetch_factor}"
        return text + (" gather=on" if self.gather else "")


MAX_WORKERS = 8
PREFETCH = 4

PERSISTENT = (
    "persistent: the workers keep the dataset as it was at the first epoch; a change made to it between epochs "
    "(set_epoch, a curriculum, an augmentation's strength) does not reach them (to have it reach them: "
    "loader_workers=0, or a DataLoader with workers of its own and persistent_workers=False, which is kept)"
)
NO_WORKERS_NEEDED = (
    "in-memory tensors need no workers: indexed in the training process, they read faster than workers send them "
    "(~4x in one measurement)"
)


GATHER = (
    "whole batches gathered from the in-memory tensors (one index per tensor, not one per sample and a stack; "
    "the same batches)"
)


WORKERS_PER_CORE = 4  # asked for beyond this many per core (or MAX_WORKERS on a small machine), workers are refused


def check_worker_count(workers: int, cores: int) -> None:
    """Refuse ``workers`` loader processes far beyond ``cores``: each is a process with its copy of the dataset, and
    a mistyped count (100000) forks until the memory is gone. Workers that wait on files or a network may usefully
    outnumber the cores a few times over, so the bound is ``WORKERS_PER_CORE`` per core."""
    most = max(MAX_WORKERS, WORKERS_PER_CORE * cores)
    if workers > most:
        raise invalid(
            "loader_workers", workers, f"at most {most} worker processes on this machine ({cores} CPU core(s): "
            f"{WORKERS_PER_CORE} per core, or {MAX_WORKERS} on fewer cores): each is a process holding its own copy "
            "of the dataset",
            f"ask for fewer (--loader-workers {min(most, max(1, cores - 1))}, say), or leave it out: the Plan picks a "
            "count for the device",
        )  # fmt: skip


def resolve_loader(loader: LoaderFacts, facts: DeviceFacts, *, workers: int | None = None) -> Choice[LoaderSettings]:
    """Pin memory and add workers for a GPU; leave a CPU run's loader alone; ``workers`` is a request that wins.

    Batches of in-memory tensors are gathered whole on any device.
    """
    chosen = _resolve(loader, facts, workers)
    if not loader.gatherable:
        return chosen
    return Choice(dataclasses.replace(chosen.value, gather=True, rebuild=True), f"{chosen.reason}; {GATHER}")


def _resolve(loader: LoaderFacts, facts: DeviceFacts, workers: int | None) -> Choice[LoaderSettings]:
    keep = LoaderSettings(
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers,
        prefetch_factor=loader.prefetch_factor,
        rebuild=False,
    )
    if not loader.is_dataloader:
        return Choice(keep, "not a DataLoader: batches are moved to the device as they come")
    if loader.subclass:
        return Choice(keep, _kept_subclass(loader, workers))
    if workers is not None:
        limited = loader.worker_limit is not None and workers > loader.worker_limit
        workers = min(workers, loader.worker_limit) if loader.worker_limit is not None else workers
        check_worker_count(workers, facts.cpu_count)  # those that would start: a stream's one is no fork bomb
        persist = _persistent(loader, workers)
        asked = LoaderSettings(
            num_workers=workers,
            pin_memory=facts.type == "cuda",
            persistent_workers=persist,
            prefetch_factor=PREFETCH if workers else None,
            rebuild=True,
        )
        why = f"{workers} of the workers asked for: {loader.limit_reason}" if limited else "requested"
        why += f"; {NO_WORKERS_NEEDED}" if workers and loader.in_memory else ""
        why += "; pinned for non-blocking copies" if facts.type == "cuda" else ""
        return Choice(asked, why + (f"; {PERSISTENT}" if persist and not loader.num_workers else ""))
    if facts.type != "cuda":
        rule = "a rule, not measured: workers could compete with the model for cores"
        return Choice(keep, f"kept: no workers added on {facts.type} ({rule})")
    if not loader.map_style:
        pinned = LoaderSettings(
            num_workers=loader.num_workers,
            pin_memory=True,
            persistent_workers=False,
            prefetch_factor=PREFETCH if loader.num_workers else None,
            rebuild=not loader.pin_memory,
        )
        return Choice(pinned, "pinned; workers kept: an iterable dataset shards itself across workers")
    if loader.num_workers > 0:
        workers, why = loader.num_workers, f"{loader.num_workers} workers set by the user"
    elif loader.in_memory:
        workers, why = 0, "in-memory tensors index faster than worker processes can send them"
    else:
        per_device = max(1, facts.cpu_count // max(1, loader.local_devices))
        workers = max(1, min(MAX_WORKERS, per_device - 1))
        if per_device > 1:
            why = f"{workers} worker{'s' if workers > 1 else ''} from {per_device} cores per device, one left for "
            why += "the training process"
        else:  # no core to spare: one worker still overlaps loading with the GPU's work
            why = f"1 worker, which shares a core with the training process ({facts.cpu_count} CPU core(s) "
            why += f"for {loader.local_devices} device(s))"
    persist = _persistent(loader, workers)
    settings = LoaderSettings(
        num_workers=workers,
        pin_memory=True,
        persistent_workers=persist,
        prefetch_factor=PREFETCH if workers else None,
        rebuild=True,
    )
    persistent = f"; {PERSISTENT}" if persist and not loader.num_workers else ""
    return Choice(settings, f"pinned memory for non-blocking copies; {why}{persistent}")


def _persistent(loader: LoaderFacts, workers: int) -> bool:
    """Whether ``workers`` should outlive an epoch: as the user set them where their loader has workers of its own;
    for workers redline adds, yes over a map-style dataset (no restart each epoch)."""
    if loader.num_workers > 0:
        return workers > 0 and loader.persistent_workers
    # A persistent worker keeps the copy of an iterable dataset it started with: the next epoch's set_epoch
    # (a new shuffle, a resumed run's position) would never reach it. Those workers start again each epoch.
    return workers > 0 and loader.map_style


def _kept_subclass(loader: LoaderFacts, workers: int | None) -> str:
    """Why a DataLoader subclass is kept as given, with what ``workers`` asked for that it does not run."""
    name = loader.subclass
    ignored = workers is not None and workers != loader.num_workers
    asked = f"loader_workers={workers} not applied ({name} runs its own {loader.num_workers}); " if ignored else ""
    return (
        f"kept as given: {name} is a DataLoader subclass, whose own __iter__ and methods a plain DataLoader rebuilt "
        f"from it would lose; {asked}for tuned workers and pinned memory pass a plain DataLoader (with the "
        f"subclass's work done in its dataset or collate_fn), or set num_workers and pin_memory on {name} yourself"
    )
