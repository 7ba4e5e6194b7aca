"""Batches of in-memory tensors gathered whole: the same batches as DataLoader's per-sample fetch, in the same order."""

import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

import redline
from redline.plan.loader import GATHER


def data(n: int = 50) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 2, 3, generator=gen), torch.randint(0, 5, (n,), generator=gen))


def loader(dataset, **kwargs) -> DataLoader:
    return DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3), **kwargs)


def assert_same_batches(plain: DataLoader, tuned) -> None:
    expected, got = list(plain), list(tuned)
    assert len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("workers", [None, 1], ids=["in-process", "one-worker"])
def test_a_tensor_dataset_is_gathered_whole_into_the_same_batches_and_the_plan_says_so(workers):
    with redline.Runtime(devices="cpu", seed=0, loader_workers=workers) as rt:
        plain, tuned = loader(data()), rt.setup_loader(loader(data()))
        assert tuned.loader.dataset.__class__.__name__ == "GatheredTensors"
        assert_same_batches(plain, tuned)
        if workers is None:  # persistent workers draw no new seed, so their later epochs depart (documented)
            assert_same_batches(plain, tuned)  # a second epoch: the sampler's next order, as plain's
        chosen = rt.explain().loader
    assert chosen is not None and str(chosen.value).endswith("gather=on") and chosen.reason.endswith(GATHER)


def test_gathering_runs_on_one_thread_and_leaves_the_processs_thread_count_as_it_was(monkeypatch):
    from redline.runtime.loading import GatheredTensors

    seen = []
    real = torch.index_select
    monkeypatch.setattr(torch, "index_select", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = GatheredTensors(data()).__getitems__([3, 1, 4])
        assert torch.get_num_threads() == 2 and seen == [1, 1]  # one call per tensor, each on one thread
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch[0], torch.stack([data()[i][0] for i in (3, 1, 4)]))


class Scaled(TensorDataset):
    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return x * 2, y


@pytest.mark.parametrize(
    "make",
    [
        lambda: loader(data(), collate_fn=lambda items: torch.utils.data.default_collate(items)),  # the user's own
        lambda: loader(Scaled(*data().tensors)),  # a subclass that indexes its own way
        lambda: loader(Subset(data(), range(40))),
        lambda: DataLoader(data(), batch_size=None),  # single items, not batches
    ],
    ids=["own-collate", "subclass", "subset", "single-items"],
)
def test_what_indexes_or_collates_its_own_way_is_fetched_as_it_was(make):
    with redline.Runtime(devices="cpu", seed=0) as rt:
        tuned = rt.setup_loader(make())
        assert_same_batches(make(), tuned)
        assert "gather" not in str(rt.explain().loader.value)


def test_the_trainers_evaluation_reads_a_tensor_dataset_gathered_in_order():
    from redline.train.data import eval_loader

    val = eval_loader(data(), batch_size=8)
    assert type(val.dataset).__name__ == "GatheredTensors"
    assert_same_batches(DataLoader(data(), batch_size=8), val)
    own = eval_loader(data(), batch_size=8, collate_fn=lambda items: torch.utils.data.default_collate(items))
    assert type(own.dataset) is TensorDataset  # a collate_fn of the task's own is left to collate


class Batches(torch.utils.data.Sampler):
    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_negative_indices_count_from_the_end_as_a_tensor_datasets_own_do():
    """A batch sampler yielding [-1, -2] failed with IndexError in the gathering, where TensorDataset takes them."""
    with redline.Runtime(devices="cpu", seed=0) as rt:
        plain, tuned = (
            DataLoader(data(), batch_sampler=Batches([[-1, -2], [3, -50]])),
            rt.setup_loader(DataLoader(data(), batch_sampler=Batches([[-1, -2], [3, -50]]))),
        )
        assert_same_batches(plain, tuned)
        for index in (50, -51):  # out of range: the error indexing the tensor gives, as without gathering
            with pytest.raises(IndexError) as torchs:
                list(DataLoader(data(), batch_sampler=Batches([[0, index]])))
            with pytest.raises(IndexError) as gathered:
                list(rt.setup_loader(DataLoader(data(), batch_sampler=Batches([[0, index]]))))
            assert (
                str(gathered.value)
                == str(torchs.value)
                == f"index {index} is out of bounds for dimension 0 with size 50"
            )
