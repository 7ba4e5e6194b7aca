"""DataLoader facts, the loader resolver's decisions, rebuilding a DataLoader and DeviceLoader on CPU."""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset

from redline.errors import ConfigError
from redline.hardware.device import DeviceFacts
from redline.plan.loader import LoaderFacts, LoaderSettings, resolve_loader
from redline.runtime.loading import DeviceLoader, loader_facts, rebuild_dataloader

H100 = DeviceFacts(type="cuda", name="NVIDIA H100 80GB HBM3", index=0, capability=(9, 0), mem_gib=80.0, cpu_count=16)
SMALL_CPU = DeviceFacts(type="cpu", name="cpu", cpu_count=2)


class Squares(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style dataset that computes its items: what a dataset reading files looks like."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(i)]), torch.tensor(i * i)


class Curriculum(Dataset[torch.Tensor]):
    """Items that change with the epoch set (a curriculum, an augmentation's strength)."""

    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(float(self.epoch))


class Counting(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(6))


def tensor_data(rows: int = 20) -> TensorDataset:
    return TensorDataset(torch.arange(rows, dtype=torch.float32).unsqueeze(1), torch.arange(rows))


def as_lists(loader: Any) -> list[list[list[float]]]:
    return [[part.tolist() for part in batch] for batch in loader]


# --- loader_facts -------------------------------------------------------------------------------


def test_facts_of_a_tensor_dataset_loader() -> None:
    facts = loader_facts(DataLoader(tensor_data(), batch_size=4, num_workers=0), local_devices=2)
    assert facts == LoaderFacts(
        is_dataloader=True,
        map_style=True,
        in_memory=True,
        num_workers=0,
        pin_memory=False,
        local_devices=2,
        gatherable=True,
    )


def test_a_subset_of_a_tensor_dataset_is_still_in_memory() -> None:
    facts = loader_facts(DataLoader(Subset(tensor_data(), [0, 2, 4]), batch_size=2))
    assert facts.in_memory
    assert facts.map_style


class Augmented(Dataset):
    """Work of its own per item over tensors it holds in .dataset, as Subset names its own."""

    def __init__(self) -> None:
        self.dataset = tensor_data()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.dataset[index]
        return x.flip(0) + 0.1 * torch.randn_like(x), y


def test_a_users_wrapper_of_a_tensor_dataset_is_not_in_memory_its_items_cost_work() -> None:
    """Any .dataset holding a TensorDataset read as in-memory: on CUDA the Plan gave it no workers."""
    assert not loader_facts(DataLoader(Augmented(), batch_size=2)).in_memory
    assert loader_facts(DataLoader(Subset(Subset(tensor_data(), [0, 1, 2]), [0, 1]), batch_size=2)).in_memory


def test_a_custom_dataset_is_not_in_memory() -> None:
    facts = loader_facts(DataLoader(Squares(8), batch_size=2, num_workers=2, pin_memory=True))
    assert (facts.is_dataloader, facts.map_style, facts.in_memory) == (True, True, False)
    assert (facts.num_workers, facts.pin_memory) == (2, True)


def test_an_iterable_dataset_is_not_map_style() -> None:
    facts = loader_facts(DataLoader(Counting(), batch_size=2))
    assert facts.is_dataloader
    assert not facts.map_style
    assert not facts.in_memory


def test_a_plain_list_of_batches_is_not_a_dataloader() -> None:
    facts = loader_facts([(torch.ones(2, 1), torch.zeros(2))])
    assert not facts.is_dataloader
    assert (facts.num_workers, facts.pin_memory) == (0, False)


# --- resolve_loader -----------------------------------------------------------------------------


def facts(**overrides: Any) -> LoaderFacts:
    values: dict[str, Any] = {
        "is_dataloader": True,
        "map_style": True,
        "in_memory": False,
        "num_workers": 0,
        "pin_memory": False,
    }
    values.update(overrides)
    return LoaderFacts(**values)


def test_cpu_keeps_the_users_loader() -> None:
    choice = resolve_loader(
        facts(num_workers=2, pin_memory=False, persistent_workers=True, prefetch_factor=3), SMALL_CPU
    )
    assert choice.value == LoaderSettings(
        num_workers=2, pin_memory=False, persistent_workers=True, prefetch_factor=3, rebuild=False
    )
    assert "kept" in choice.reason
    assert "a rule, not measured" in choice.reason  # it said workers "would compete", as if measured


@pytest.mark.parametrize(("device", "most"), [(SMALL_CPU, 8), (H100, 64)])
def test_a_worker_count_far_past_the_cores_is_refused_before_any_worker_starts(device, most):
    # --loader-workers 100000 forked until the machine's memory was gone, and ignored SIGTERM meanwhile.
    assert resolve_loader(facts(), device, workers=most).value.num_workers == most
    with pytest.raises(ConfigError) as refused:
        resolve_loader(facts(), device, workers=most + 1)
    message = str(refused.value)
    assert message.startswith(f"loader_workers={most + 1} is not allowed; expected at most {most} worker processes")
    assert f"({device.cpu_count} CPU core(s): 4 per core, or 8 on fewer cores)" in message
    assert "hint: ask for fewer" in message
    # a stream read by one worker at most starts one: the count asked for is no fork bomb there
    assert resolve_loader(facts(worker_limit=1), device, workers=most + 1).value.num_workers == 1


@pytest.mark.parametrize("device", [H100, SMALL_CPU])
def test_workers_asked_for_over_in_memory_tensors_are_given_and_said_to_be_unneeded(device) -> None:
    choice = resolve_loader(facts(in_memory=True), device, workers=2)
    assert choice.value.num_workers == 2
    assert "in-memory tensors need no workers" in choice.reason
    assert "need no workers" not in resolve_loader(facts(), device, workers=2).reason


def test_a_loader_rebuilt_to_gather_its_batches_keeps_every_worker_setting_the_user_made() -> None:
    """On CPU a TensorDataset's loader is rebuilt only to gather whole batches: its workers stay as the user set them
    (not persistent, a deeper prefetch, batches out of order), which the Plan shows."""
    import redline

    loader = DataLoader(
        tensor_data(), batch_size=4, num_workers=2, persistent_workers=False, prefetch_factor=6, in_order=False
    )
    rt = redline.Runtime(devices="cpu", compile="off")
    rebuilt = rt.setup_loader(loader).loader
    assert isinstance(rebuilt, DataLoader) and rebuilt is not loader  # gathered: rebuilt
    assert (rebuilt.num_workers, rebuilt.persistent_workers, rebuilt.prefetch_factor) == (2, False, 6)
    assert rebuilt.in_order is False
    assert str(rt.explain().loader.value) == "workers=2 pin_memory=off persistent=off prefetch=6 gather=on"


def test_cuda_with_in_memory_tensors_pins_without_workers() -> None:
    choice = resolve_loader(facts(in_memory=True), H100)
    assert choice.value == LoaderSettings(
        num_workers=0, pin_memory=True, persistent_workers=False, prefetch_factor=None, rebuild=True
    )
    assert "in-memory" in choice.reason


def test_cuda_with_a_custom_dataset_uses_workers_up_to_the_cap() -> None:
    choice = resolve_loader(facts(), H100)
    # min(MAX_WORKERS=8, 16 cores - 1 for the training process) = 8
    assert choice.value == LoaderSettings(
        num_workers=8, pin_memory=True, persistent_workers=True, prefetch_factor=4, rebuild=True
    )
    assert "pinned" in choice.reason


@pytest.mark.parametrize(("local_devices", "workers"), [(8, 1), (4, 3), (2, 7), (1, 8), (32, 1)])
def test_cores_are_shared_between_the_local_devices(local_devices: int, workers: int) -> None:
    choice = resolve_loader(facts(local_devices=local_devices), H100)
    assert choice.value.num_workers == workers
    assert choice.value.persistent_workers
    assert choice.value.prefetch_factor == 4


def test_a_worker_without_a_core_of_its_own_is_not_said_to_leave_one() -> None:
    choice = resolve_loader(facts(local_devices=32), H100)  # 16 cores for 32 devices
    assert choice.value.num_workers == 1
    assert "one left for the training process" not in choice.reason
    assert "shares" in choice.reason and "1 workers" not in choice.reason


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_set_by_the_user_are_kept_on_cuda_persistent_or_not_as_set(persistent: bool) -> None:
    """Made persistent, a user's workers kept the dataset of the first epoch: what set_epoch changed never reached
    them, where the user had asked for persistent_workers=False."""
    choice = resolve_loader(facts(num_workers=3, persistent_workers=persistent), H100)
    assert choice.value == LoaderSettings(
        num_workers=3, pin_memory=True, persistent_workers=persistent, prefetch_factor=4, rebuild=True
    )
    assert "user" in choice.reason and "persistent:" not in choice.reason


@pytest.mark.parametrize(("device", "workers"), [(H100, None), (H100, 2), (SMALL_CPU, 2)])
def test_workers_redline_adds_are_persistent_and_the_plan_says_what_that_means(device, workers) -> None:
    choice = resolve_loader(facts(), device, workers=workers)
    assert choice.value.persistent_workers
    assert "persistent: the workers keep the dataset as it was at the first epoch" in choice.reason
    assert "loader_workers=0" in choice.reason and "persistent_workers=False" in choice.reason


def test_a_users_loader_with_workers_not_persistent_sees_each_epochs_dataset_with_workers_requested() -> None:
    import redline

    dataset = Curriculum()
    with redline.Runtime(devices="cpu", loader_workers=2) as rt:
        loader = rt.setup_loader(DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=False))
        seen = []
        for epoch in range(3):
            dataset.set_epoch(epoch)
            seen.append(sorted({float(v) for batch in loader for v in batch}))
        assert seen == [[0.0], [1.0], [2.0]]  # persistent workers saw [0.0] each epoch
        assert "persistent:" not in rt.explain().loader.reason


@pytest.mark.filterwarnings("ignore:This DataLoader will create 7 worker processes")  # built, never started
def test_setup_loader_shares_the_cores_among_the_processes_launched_on_the_machine() -> None:
    """Under `redline launch --nproc 8` on 16 cores each rank took 8 workers (64 in all): local_devices stayed 1."""
    import redline

    rt = redline.Runtime(devices="cpu", compile="off")
    rt.facts, rt.env = H100, dataclasses.replace(rt.env, local_world_size=8)  # one of 8 ranks on a 16-core GPU machine
    assert rt.setup_loader(DataLoader(Squares(8), batch_size=2)).loader.num_workers == 1  # 16 // 8 cores, one kept
    assert "2 cores per device" in rt.explain().loader.reason
    assert rt.setup_loader(DataLoader(Squares(8), batch_size=2), local_devices=2).loader.num_workers == 7


@pytest.mark.parametrize(
    ("workers", "pinned", "expected"),
    [
        (
            0,
            False,
            LoaderSettings(
                num_workers=0, pin_memory=True, persistent_workers=False, prefetch_factor=None, rebuild=True
            ),
        ),
        (
            2,
            False,
            LoaderSettings(num_workers=2, pin_memory=True, persistent_workers=False, prefetch_factor=4, rebuild=True),
        ),
        (
            2,
            True,
            LoaderSettings(num_workers=2, pin_memory=True, persistent_workers=False, prefetch_factor=4, rebuild=False),
        ),
    ],
)
def test_an_iterable_dataset_is_pinned_and_keeps_its_workers(
    workers: int, pinned: bool, expected: LoaderSettings
) -> None:
    choice = resolve_loader(facts(map_style=False, num_workers=workers, pin_memory=pinned), H100)
    assert choice.value == expected
    assert "iterable" in choice.reason


def test_requested_workers_of_an_iterable_dataset_start_again_each_epoch() -> None:
    # a persistent worker keeps its own copy of the dataset: set_epoch in the main process would not reach it
    assert not resolve_loader(facts(map_style=False), SMALL_CPU, workers=2).value.persistent_workers
    assert resolve_loader(facts(), SMALL_CPU, workers=2).value.persistent_workers


def test_something_that_is_not_a_dataloader_is_kept() -> None:
    choice = resolve_loader(facts(is_dataloader=False), H100)
    assert not choice.value.rebuild
    assert choice.value.num_workers == 0
    assert not choice.value.pin_memory
    assert "not a DataLoader" in choice.reason


# --- rebuild_dataloader -------------------------------------------------------------------------

WORKERS = LoaderSettings(num_workers=2, pin_memory=False, persistent_workers=True, prefetch_factor=2, rebuild=True)


def shuffled_loader(**kwargs: Any) -> DataLoader[Any]:
    return DataLoader(
        tensor_data(),
        batch_size=3,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )


def epochs_of(make_loader: Callable[[], DataLoader[Any]], epochs: int = 1) -> list[list[Any]]:
    """Return the batches of each epoch; the loader (and its persistent workers) ends with this call."""
    loader = make_loader()
    return [list(loader) for _ in range(epochs)]


def test_rebuilt_loader_takes_the_worker_settings() -> None:
    rebuilt = rebuild_dataloader(DataLoader(Squares(7), batch_size=3), WORKERS)
    assert (rebuilt.num_workers, rebuilt.persistent_workers, rebuilt.prefetch_factor) == (2, True, 2)
    assert not rebuilt.pin_memory


def test_rebuilt_loader_yields_the_same_batches_in_the_same_order() -> None:
    reference = as_lists(shuffled_loader())
    (rebuilt,) = epochs_of(lambda: rebuild_dataloader(shuffled_loader(), WORKERS))

    assert as_lists(rebuilt) == reference
    assert len(reference) == 6
    # Shuffled: the order is not just the dataset's.
    assert [row for batch in reference for row in batch[1]] != list(range(18))


def test_rebuilt_loader_with_persistent_workers_is_deterministic_across_epochs() -> None:
    """Documented: later epochs depart from the untuned loader's order, but a seed still fixes them."""
    first = [as_lists(epoch) for epoch in epochs_of(lambda: rebuild_dataloader(shuffled_loader(), WORKERS), epochs=2)]
    again = [as_lists(epoch) for epoch in epochs_of(lambda: rebuild_dataloader(shuffled_loader(), WORKERS), epochs=2)]
    assert first == again
    assert first[0] != first[1]  # still reshuffled every epoch


def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    return {"x": torch.stack([x for x, _ in items]), "n": len(items)}


def test_rebuilt_loader_keeps_batch_size_drop_last_and_collate_fn() -> None:
    original = DataLoader(Squares(7), batch_size=3, drop_last=True, collate_fn=collate)
    rebuilt = rebuild_dataloader(original, WORKERS)
    assert rebuilt.collate_fn is collate
    assert len(rebuilt) == 2

    (batches,) = epochs_of(lambda: rebuild_dataloader(original, WORKERS))
    assert [b["n"] for b in batches] == [3, 3]
    assert [b["x"].flatten().tolist() for b in batches] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_rebuilt_loader_reports_the_users_batch_size_and_drop_last() -> None:
    original = DataLoader(Squares(7), batch_size=3, drop_last=True)
    rebuilt = rebuild_dataloader(original, WORKERS)
    assert DeviceLoader(rebuilt, torch.device("cpu")).batch_size == 3
    assert rebuilt.drop_last


def test_rebuilt_loader_keeps_the_last_short_batch_without_drop_last() -> None:
    original = DataLoader(Squares(7), batch_size=3)
    rebuilt = rebuild_dataloader(original, dataclasses.replace(WORKERS, num_workers=0, persistent_workers=True))
    assert rebuilt.num_workers == 0
    assert not rebuilt.persistent_workers
    assert as_lists(rebuilt) == as_lists(original)
    assert len(rebuilt) == 3


def test_rebuilt_iterable_loader_keeps_its_batches() -> None:
    original = DataLoader(Counting(), batch_size=4, drop_last=True)
    rebuilt = rebuild_dataloader(original, dataclasses.replace(WORKERS, num_workers=0))
    assert [b.tolist() for b in rebuilt] == [[0, 1, 2, 3]]


def test_rebuilt_loader_without_automatic_batching_yields_single_items() -> None:
    original = DataLoader(tensor_data(4), batch_size=None)
    rebuilt = rebuild_dataloader(original, dataclasses.replace(WORKERS, num_workers=0))
    items = list(rebuilt)
    assert all(isinstance(part, torch.Tensor) for item in items for part in item)
    assert as_lists(items) == as_lists(original)


# --- DeviceLoader -------------------------------------------------------------------------------


def test_device_loader_on_cpu_passes_batches_through() -> None:
    batches = [(torch.randn(2, 3), torch.tensor([0, 1])), (torch.randn(2, 3), torch.tensor([1, 1]))]
    out = list(DeviceLoader(batches, torch.device("cpu")))
    assert len(out) == 2
    for given, got in zip(batches, out, strict=True):
        assert got is given


def test_device_loader_matches_the_wrapped_dataloader() -> None:
    loader = DataLoader(tensor_data(10), batch_size=4)
    wrapped = DeviceLoader(loader, torch.device("cpu"))
    assert len(wrapped) == 3
    assert wrapped.dataset is loader.dataset
    assert wrapped.batch_size == 4
    assert as_lists(wrapped) == as_lists(loader)
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute  # noqa: B018


def test_device_loader_moves_batches_to_its_device() -> None:
    loader = DataLoader(tensor_data(6), batch_size=4)
    out = list(DeviceLoader(loader, torch.device("meta")))
    assert [tuple(x.shape) for x, _ in out] == [(4, 1), (2, 1)]
    assert all(t.device.type == "meta" for batch in out for t in batch)


def test_device_loader_with_channels_last_lays_out_images_nhwc() -> None:
    images = torch.randn(4, 3, 5, 5)
    loader = DataLoader(TensorDataset(images, torch.arange(4)), batch_size=2)
    out = list(DeviceLoader(loader, torch.device("cpu"), channels_last=True))

    assert len(out) == 2
    for i, (x, y) in enumerate(out):
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert not x.is_contiguous()
        assert torch.equal(x, images[2 * i : 2 * i + 2])
        assert y.tolist() == [2 * i, 2 * i + 1]


def test_device_loader_with_channels_last_leaves_the_targets_of_a_pair_nchw() -> None:
    # a segmentation mask laid out NHWC failed the user's loss at target.view(len(target), -1), at the step a CPU
    # with AMX switched to bf16 and channels_last
    images, masks = torch.randn(4, 3, 5, 5), torch.rand(4, 1, 5, 6).round()
    loader = DataLoader(TensorDataset(images, masks.expand(4, 2, 5, 6).contiguous()), batch_size=2)
    for x, y in DeviceLoader(loader, torch.device("cpu"), channels_last=True):
        assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        assert y.is_contiguous() and y.view(len(y), -1).shape == (2, 60)
    three = DataLoader(TensorDataset(images, images, torch.arange(4)), batch_size=2)  # not a pair: every image
    assert all(
        b.is_contiguous(memory_format=torch.channels_last)
        for _, b, _ in DeviceLoader(three, torch.device("cpu"), channels_last=True)
    )


class Numbered(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return ((torch.tensor([float(i)]), torch.tensor(i % 2)) for i in range(16))


def test_a_trainer_stream_read_by_workers_gives_each_item_once_in_order_and_resumes() -> None:
    import redline
    from redline.train.data import train_loader

    loader, stream = train_loader(Numbered(), batch_size=4, seed=0)
    with redline.Runtime(devices="cpu", loader_workers=2) as rt:
        rt.setup(torch.nn.Linear(1, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        batches = rt.setup_loader(loader)
        stream.set_epoch(0)
        assert [b[0].flatten().tolist() for b in batches] == [[4.0 * i + j for j in range(4)] for i in range(4)]
        stream.set_epoch(1, skip=8)  # a resumed run, two batches into its epoch
        assert [b[0].flatten().tolist() for b in batches] == [[8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]]


def test_a_dataset_given_to_setup_loader_is_refused_with_the_wrapping_and_a_stream_of_batches_is_taken() -> None:
    """Iterated, a map-style dataset gives its samples one at a time: the loop would train on unbatched samples."""
    import redline
    from redline.errors import ConfigError

    rt = redline.Runtime(devices="cpu", compile="off")
    with pytest.raises(ConfigError, match=r"(?s)'TensorDataset'.*hint: wrap it: rt\.setup_loader\(DataLoader\(dataset"):
        rt.setup_loader(tensor_data())
    assert len(list(rt.setup_loader(Counting()))) == len(list(Counting()))  # an iterable dataset may yield batches

    class Indexed:  # iterable by the old protocol (__getitem__ until IndexError), as iter() takes it
        def __getitem__(self, i):
            if i >= 2:
                raise IndexError(i)
            return torch.ones(2, 3), torch.zeros(2)

    assert len(list(rt.setup_loader(Indexed()))) == 2
    # a tensor iterates its rows, one sample each, and a number nothing: it said TypeError: 'int' object is not iterable
    for given, kind in ((torch.randn(64, 8), "'Tensor'"), (5, "'int'")):
        with pytest.raises(ConfigError) as refused:
            rt.setup_loader(given)
        assert str(refused.value).startswith(f"setup_loader(loader)={kind} is not allowed; expected a DataLoader")
        assert "hint: wrap tensors: rt.setup_loader(DataLoader(TensorDataset(x, y), batch_size=64" in str(refused.value)


class Unsplit(IterableDataset):
    """A stream that does not split itself across workers: each worker would yield all of it."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(8.0).split(1))


class SelfSplitting(Unsplit):
    splits_across_workers = True


@pytest.mark.parametrize(
    ("dataset", "own_workers", "asked", "warned"),
    [
        (Unsplit(), 0, 2, True),  # asked for: every sample would come twice, unsaid
        (Unsplit(), 0, 1, False),  # one worker runs the stream once
        (Unsplit(), 2, 2, False),  # the loader's own workers: as the user built it, plain torch alike
        (SelfSplitting(), 0, 2, False),  # a stream that says it splits itself
    ],
)
def test_workers_asked_for_over_a_stream_that_may_not_split_itself_are_warned_of(
    caplog, dataset, own_workers, asked, warned
):
    loader = DataLoader(dataset, batch_size=2, num_workers=own_workers)
    settings = LoaderSettings(num_workers=asked, pin_memory=False, persistent_workers=False, prefetch_factor=2,
                              rebuild=True)  # fmt: skip
    with caplog.at_level("WARNING", logger="redline"):
        rebuilt = rebuild_dataloader(loader, settings)
    assert rebuilt.num_workers == asked  # warned, not refused: the request stands
    said = [r.getMessage() for r in caplog.records if "IterableDataset" in r.getMessage()]
    if warned:
        assert said and said[0].startswith(f"{asked} loader workers over Unsplit, an IterableDataset")
        assert f"yields every sample {asked} times" in said[0] and "splits_across_workers = True" in said[0]
    else:
        assert not said


def recording_loss(seen: list[int]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loss that records the targets each training step is given (not the FLOP count's on meta, nor evaluation's)."""

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if out.device.type != "meta" and torch.is_grad_enabled():
            seen.extend(y.tolist())
        return out.float().pow(2).mean()

    return loss_fn


class SplitsItselfByWorker(IterableDataset):
    """Torch's documented way to share a stream among workers: each yields every num_workers-th item (unsaid)."""

    def __len__(self) -> int:
        return 32

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, 32, workers):
            yield torch.full((4,), float(i)), torch.tensor(i)


class SaysItSplitsByWorker(SplitsItselfByWorker):
    splits_across_workers = True


class ReadWholeByEachWorker(IterableDataset):
    """A stream that each worker runs in full."""

    def __len__(self) -> int:
        return 32

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return ((torch.full((4,), float(i)), torch.tensor(i)) for i in range(32))


@pytest.mark.parametrize("stream", [SplitsItselfByWorker, SaysItSplitsByWorker, ReadWholeByEachWorker])
def test_the_trainer_reads_a_stream_in_one_worker_and_trains_on_each_item_once(caplog, stream):
    """Two workers each read half of a stream that splits itself (said or not), and the Trainer's global batches
    kept half of those: half the data was lost, and nothing said."""
    from test_trainer import tiny_task

    import redline
    from redline.train.trainer import Trainer

    seen: list[int] = []
    loss_fn = recording_loss(seen)

    task = tiny_task(train_data=stream(), val_data=None, metric=None, loss_fn=loss_fn, epochs=2)
    options = redline.RuntimeOptions(devices="cpu", seed=0, loader_workers=2)
    with caplog.at_level("WARNING", logger="redline"):
        summary = Trainer(task, runtime=options, progress=False, trial="off").fit()
    assert summary.steps == 8
    assert sorted(seen) == sorted(list(range(32)) * 2)  # each item once an epoch, none lost nor repeated
    loader = summary.plan.loader
    assert loader is not None and loader.value.num_workers == 1
    assert loader.reason.startswith(f"1 of the workers asked for: train_data ({stream.__name__}) is a stream")
    assert not [r for r in caplog.records if "IterableDataset" in r.getMessage()]  # one worker: nothing to warn of


def test_a_dataset_class_of_a_task_file_loads_in_workers_started_by_spawn(tmp_path, monkeypatch):
    """macOS starts workers by spawn (Linux by forkserver from Python 3.14): they import the class by its module."""
    import sys

    from redline.task import load_task

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "redline_spawned_task_5d0.py").write_text(
        "import torch\nfrom torch import nn\nfrom redline import Task\n\n"
        "class Items(torch.utils.data.Dataset):\n    def __len__(self):\n        return 8\n\n"
        "    def __getitem__(self, i):\n        return torch.full((4,), float(i)), i % 2\n\n"
        "def make():\n    return Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, "
        "train_data=Items(), batch_size=4)\n"
    )
    monkeypatch.delitem(sys.modules, "redline_spawned_task_5d0", raising=False)
    task = load_task(f"{tmp_path / 'redline_spawned_task_5d0.py'}:make")
    loader = DataLoader(task.train_data, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    assert [x[:, 0].tolist() for x, _ in loader] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    sys.modules.pop("redline_spawned_task_5d0")


class MissingFile(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index == 7:
            raise KeyError("missing file 7")
        return torch.randn(4), index % 2


def test_an_error_in_a_loader_worker_says_its_own_message_and_line_not_torchs_wrapping():
    """It said "KeyError: Caught KeyError in DataLoader worker process 1.": neither 'missing file 7' nor the line."""
    from test_trainer import tiny_task

    import redline
    from redline.errors import TrainingError
    from redline.train.trainer import Trainer

    task = tiny_task(train_data=MissingFile(), val_data=None, metric=None, epochs=1)
    options = redline.RuntimeOptions(devices="cpu", seed=0, loader_workers=2)
    before = set(multiprocessing.active_children())
    with pytest.raises(TrainingError) as raised:
        Trainer(task, runtime=options, progress=False, trial="off").fit()
    said = str(raised.value)
    assert "reading a batch of the data raised KeyError in a loader worker: 'missing file 7'" in said, said
    assert f"\n  at {__file__}:" in said and 'in __getitem__: raise KeyError("missing file 7")' in said
    # The error's traceback holds the loader: its workers lived on until a garbage collection stopped them, 5 s each
    assert set(multiprocessing.active_children()) <= before, "the loader's workers outlived the error"


class MissingOnce(Dataset):
    """Item 5 is missing until ``fixed`` exists (the workers are other processes: a file tells them)."""

    def __init__(self, fixed: Path) -> None:
        self.fixed = fixed

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 5 and not self.fixed.exists():
            raise KeyError("missing file 5")
        return torch.tensor([float(index)])


def test_persistent_workers_that_met_an_error_read_the_next_epoch(tmp_path):
    # Their DataLoader keeps their iterator for the next epoch: stopped after the error, it raised "Queue is closed"
    import redline
    from redline.errors import TrainingError

    with redline.Runtime(devices="cpu", loader_workers=2) as rt:
        loader = rt.setup_loader(DataLoader(MissingOnce(tmp_path / "fixed"), batch_size=2, num_workers=2,
                                            persistent_workers=True))  # fmt: skip
        with pytest.raises(TrainingError, match="missing file 5"):
            list(loader)
        (tmp_path / "fixed").touch()
        assert [batch.flatten().tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


class LongerThanSaid(IterableDataset):
    """Says 20 items a pass, yields 64."""

    def __len__(self) -> int:
        return 20

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(64):
            yield torch.full((4,), float(i)), torch.tensor(i)


def test_a_stream_that_yields_more_than_its_length_is_cut_there_each_epoch_and_said(caplog):
    """An epoch read the whole pass and a batch of the next: 3 epochs asked, 1.33 trained, and nothing said."""
    from test_trainer import tiny_task

    import redline
    from redline.train.trainer import Trainer

    seen: list[int] = []
    loss_fn = recording_loss(seen)

    task = tiny_task(train_data=LongerThanSaid(), val_data=None, metric=None, loss_fn=loss_fn, epochs=2)
    with caplog.at_level("WARNING", logger="redline"):
        summary = Trainer(
            task, runtime=redline.RuntimeOptions(devices="cpu", seed=0), progress=False, trial="off"
        ).fit()
    assert seen == [*range(20), *range(20)] and summary.steps == 6  # batches of 8, 8 and 4, twice
    said = [r.getMessage() for r in caplog.records if "more items in one pass" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("train_data (LongerThanSaid) yields more items in one pass than its")


class Noisy(Dataset):
    """An augmentation drawn in the loader worker: each item's target is its noise."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4,), float(index)), torch.rand(())


def test_a_resumed_runs_loader_workers_do_not_replay_the_first_epochs_random_streams(tmp_path):
    """The loader's generator was seeded by the seed alone: resumed mid-epoch, its worker drew again the noise the
    first epoch had drawn, now over the samples left."""
    from test_trainer import tiny_task

    import redline
    from redline.train.trainer import Trainer

    def fit(max_steps: int, **kwargs: Any) -> list[float]:
        seen: list[float] = []
        task = tiny_task(train_data=Noisy(), val_data=None, metric=None, loss_fn=recording_loss(seen), epochs=3)
        options = redline.RuntimeOptions(devices="cpu", seed=0, loader_workers=1)
        Trainer(task, runtime=options, progress=False, trial="off", max_steps=max_steps, **kwargs).fit()
        return seen

    first = fit(7, out_dir=tmp_path)  # 5 batches of 8 an epoch: stopped in the second
    resumed = fit(10, out_dir=tmp_path, resume="auto")
    assert len(first) == 56 and len(resumed) == 24
    assert not set(first) & set(resumed), "the resumed run drew the same noise again"
    assert first == fit(7, out_dir=tmp_path / "again")  # a seeded run draws the same again
