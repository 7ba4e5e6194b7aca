"""The data order and the split of a global batch across ranks, without processes."""

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from redline.errors import ConfigError
from redline.parallel.env import DistEnv
from redline.runtime.sampling import EpochSampler, GlobalBatchSampler, batches_per_epoch, global_batches, split_caveats


def ranks(size: int, global_batch: int, world: int, epoch: int = 0, skip: int = 0) -> list[list[list[int]]]:
    """Each rank's batches of one epoch."""
    out = []
    for rank in range(world):
        sampler = EpochSampler(size, shuffle=True, seed=3)
        sampler.set_epoch(epoch, skip=skip)
        out.append(list(GlobalBatchSampler(sampler, global_batch=global_batch, rank=rank, world_size=world)))
    return out


def test_the_ranks_shares_put_together_are_the_one_process_batches():
    (alone,) = ranks(20, 8, 1)
    two = ranks(20, 8, 2)
    assert [a + b for a, b in zip(*two, strict=True)] == alone  # 8, 8, and the last 4 split evenly: kept
    assert [len(batch) for batch in two[0]] == [4, 4, 2]
    assert sorted(i for rank in two for batch in rank for i in batch) == list(range(20))  # each sample once


def test_a_last_batch_that_does_not_split_is_dropped_rather_than_padded():
    three = ranks(19, 6, 3)  # 3 full batches and a last one of 1
    assert [len(batches) for batches in three] == [3, 3, 3]
    assert batches_per_epoch(19, 6, 3) == 3 and batches_per_epoch(19, 6, 1) == 4


def test_the_order_depends_on_seed_and_epoch_only_and_resumes_mid_epoch():
    full = ranks(20, 4, 2, epoch=1)
    resumed = ranks(20, 4, 2, epoch=1, skip=8)  # two global batches already trained
    assert [batches[2:] for batches in full] == resumed
    assert ranks(20, 4, 2, epoch=2) != full


def test_an_indivisible_global_batch_names_the_nearest_that_splits():
    with pytest.raises(
        ConfigError, match=r"(?s)batch_size=10 is not allowed; expected a multiple of 4.*e\.g\. batch_size=12"
    ):
        GlobalBatchSampler(EpochSampler(40, shuffle=False, seed=0), global_batch=10, rank=0, world_size=4)
    with pytest.raises(ConfigError, match=r"e\.g\. batch_size=63$"):  # 63 is 1 away, 66 two: it said 66
        GlobalBatchSampler(EpochSampler(64, shuffle=False, seed=0), global_batch=64, world_size=3)
    with pytest.raises(ConfigError, match=r"e\.g\. batch_size=3$"):  # never 0
        GlobalBatchSampler(EpochSampler(64, shuffle=False, seed=0), global_batch=1, world_size=3)


def test_the_layers_that_depend_on_the_split_are_named():
    assert split_caveats(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)), world_size=2) == []
    both = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.BatchNorm1d(2), nn.Dropout(0.1))
    caveats = split_caveats(both, world_size=2)
    assert len(caveats) == 2
    assert caveats[0].startswith("2 BatchNorm layer(s)") and "SyncBatchNorm" in caveats[0]
    assert "dropout" in caveats[1]
    assert split_caveats(nn.SyncBatchNorm(2), world_size=2) == []  # already global
    assert split_caveats(both, world_size=1) == []  # one process splits nothing


TWO_RANKS = DistEnv(rank=1, world_size=2)


def loader_with(sampler_of: Callable[[TensorDataset], Any] | None = None, **options: Any) -> DataLoader:
    data = TensorDataset(torch.arange(12.0))
    return DataLoader(data, batch_size=4, sampler=sampler_of(data) if sampler_of else None, **options)


@pytest.mark.parametrize(
    "sampler_of",
    [
        lambda data: WeightedRandomSampler([1.0] * 6 + [0.0] * 6, num_samples=12),
        lambda data: SubsetRandomSampler(range(6)),
        lambda data: RandomSampler(data, replacement=True),
        lambda data: RandomSampler(data, num_samples=6),
    ],
    ids=["weighted", "subset", "replacement", "fewer-samples"],
)
def test_a_sampler_whose_order_the_split_would_drop_is_refused_naming_it(sampler_of):
    """Split over the ranks, every sample would come once an epoch: the weights, the subset (a validation split
    training with the rest), the draws with replacement would all be gone, with no word."""
    loader = loader_with(sampler_of)
    with pytest.raises(ConfigError, match=type(loader.sampler).__name__) as refused:
        global_batches(loader, TWO_RANKS, seed=0)
    assert "DistributedSampler" in str(refused.value)


def test_the_users_distributed_sampler_is_kept_and_a_plain_order_is_split():
    """A ported DDP script's DistributedSampler already gives each rank its share (and shuffles, per set_epoch)."""
    split = loader_with(lambda data: DistributedSampler(data, num_replicas=2, rank=1, shuffle=True))
    assert global_batches(split, TWO_RANKS, seed=0) is None
    for loader in (loader_with(), loader_with(shuffle=True)):
        batches = global_batches(loader, TWO_RANKS, seed=0)
        assert isinstance(batches, GlobalBatchSampler) and batches.local_batch == 2
    assert global_batches(loader_with(lambda data: SubsetRandomSampler(range(6))), DistEnv(), seed=0) is None


def test_a_loader_set_up_again_each_epoch_goes_on_to_the_next_epochs_order():
    """A loop that calls rt.setup_loader(loader) at the top of each epoch: with a new split each time, every epoch
    under several processes read epoch 0's shuffle again, where one process reshuffles each epoch."""
    loader = loader_with(shuffle=True)
    epoch_0 = list(global_batches(loader, TWO_RANKS, seed=0))
    epoch_1 = list(global_batches(loader, TWO_RANKS, seed=0))
    assert epoch_1 != epoch_0 and sorted(map(len, epoch_1)) == sorted(map(len, epoch_0))  # reshuffled, as many
    other = list(global_batches(loader, TWO_RANKS, seed=1))  # another run's seed: its own order from its epoch 0
    assert other == list(
        GlobalBatchSampler(EpochSampler(12, shuffle=True, seed=1), global_batch=4, rank=1, world_size=2)
    )


def test_a_loader_that_drops_its_last_short_batch_drops_it_on_every_rank():
    """10 samples in batches of 4: one process drops the last 2 (drop_last=True); split over two ranks, that batch
    splits evenly and was kept, so two processes took one step more than one process."""
    data = TensorDataset(torch.arange(10.0))
    alone = [len(batch[0]) for batch in DataLoader(data, batch_size=4, drop_last=True)]
    split = global_batches(DataLoader(data, batch_size=4, drop_last=True), DistEnv(rank=0, world_size=2), seed=0)
    assert split is not None
    assert [len(batch) * 2 for batch in split] == alone == [4, 4] and len(split) == 2


def test_without_a_seed_the_order_is_drawn_as_a_plain_shuffling_loader_draws_its_own():
    """Before, an unseeded run under several processes read seed 0's order every time: each run the same shuffle."""

    def first_epoch(**loader_options) -> list[list[int]]:
        return list(global_batches(loader_with(shuffle=True, **loader_options), TWO_RANKS, seed=None))

    torch.manual_seed(3)
    seeded_3 = first_epoch()
    torch.manual_seed(3)
    assert first_epoch() == seeded_3  # torch.manual_seed fixes it, as it fixes a plain DataLoader's
    draws = [first_epoch() for _ in range(4)]  # torch's stream goes on: another order each time
    assert len({str(d) for d in [seeded_3, *draws]}) == 5
    ordered = first_epoch(generator=torch.Generator().manual_seed(5))  # the loader's own generator decides
    assert ordered == first_epoch(generator=torch.Generator().manual_seed(5)) != seeded_3
    before = torch.get_rng_state()
    in_order = list(global_batches(loader_with(), TWO_RANKS, seed=None))  # not shuffled: nothing drawn
    assert in_order == list(
        GlobalBatchSampler(EpochSampler(12, shuffle=False, seed=0), global_batch=4, rank=1, world_size=2)
    )
    assert torch.equal(before, torch.get_rng_state())
    loader = loader_with(shuffle=True)
    epoch_0 = list(global_batches(loader, TWO_RANKS, seed=None))
    drawn = torch.get_rng_state()
    assert not torch.equal(before, drawn)  # its first set-up drew the seed
    epoch_1 = list(global_batches(loader, TWO_RANKS, seed=None))  # set up again: its next epoch, no new draw
    assert torch.equal(drawn, torch.get_rng_state()) and epoch_1 != epoch_0


def test_a_loader_set_up_under_several_processes_goes_on_from_the_epoch_it_is_told():
    """A loop resumed under `redline launch` read epoch 0's order again: the split's epochs count this process's
    passes. set_epoch, as a DistributedSampler's, is how it goes on; with one process it does nothing."""
    import torch
    from torch.utils.data import DataLoader

    from redline.runtime.loading import DeviceLoader

    def epochs(loader, n):
        return [[batch.tolist() for batch in loader] for _ in range(n)]

    def split_loader():
        order = EpochSampler(16, shuffle=True, seed=0, auto_epoch=True)
        split = GlobalBatchSampler(order, global_batch=4, rank=1, world_size=2)
        return DeviceLoader(DataLoader(list(range(16)), batch_sampler=split), torch.device("cpu"))

    unbroken = epochs(split_loader(), 3)
    resumed = split_loader()
    resumed.set_epoch(1)
    assert epochs(resumed, 2) == unbroken[1:], "epoch 1, then 2, as the unbroken run read them"
    plain = DeviceLoader(DataLoader(list(range(4)), batch_size=2), torch.device("cpu"))
    plain.set_epoch(5)  # one process: its own order, left alone
    assert epochs(plain, 1) == [[[0, 1], [2, 3]]]


def test_a_loader_the_split_leaves_alone_under_several_processes_is_warned_of(caplog):
    """A DataLoader with its own batch_sampler, or an iterable of batches, was read whole by every rank, silently."""
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    env = DistEnv(rank=0, world_size=2, launched=True)
    own = DataLoader(list(range(8)), batch_sampler=BatchSampler(SequentialSampler(range(8)), 4, False))
    with caplog.at_level("WARNING", logger="redline"):
        assert global_batches(own, env, seed=0) is None
        assert global_batches([[0, 1], [2, 3]], env, seed=0) is None
        split = GlobalBatchSampler(EpochSampler(8, shuffle=False, seed=0), global_batch=4, world_size=2)
        assert global_batches(DataLoader(list(range(8)), batch_sampler=split), env, seed=0) is None  # the Trainer's
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("setup_loader keeps a DataLoader with a batch_sampler as it is: each")
    assert said[1].startswith("setup_loader keeps an iterable of batches as it is: each of the 2 processes reads every")


class Numbers(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(8)


class NumbersOfThisRank(Numbers):
    splits_across_ranks = True  # its __iter__ would yield this rank's share


def test_a_stream_every_rank_reads_whole_is_warned_of_and_said_on_the_loader_line(caplog):
    """Two ranks each read all 8 items of an IterableDataset, silently, where a stream that says it splits itself is
    left alone."""
    from redline.plan import Choice
    from redline.runtime.sampling import split_reason

    env, chosen = DistEnv(rank=0, world_size=2, launched=True), Choice("kept", "the loader as given")
    stream, own = DataLoader(Numbers(), batch_size=4), DataLoader(NumbersOfThisRank(), batch_size=4)
    with caplog.at_level("WARNING", logger="redline"):
        assert global_batches(stream, env, seed=0) is None and global_batches(own, env, seed=0) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("setup_loader keeps a DataLoader over an IterableDataset (Numbers)")
    assert "each of the 2 processes reads the whole stream" in said[0] and "splits_across_ranks = True" in said[0]
    assert split_reason(chosen, stream, [], env).reason.endswith("not split: every rank reads the whole stream "
                                                                  "(splits_across_ranks unset)")  # fmt: skip
    assert split_reason(chosen, own, [], env) == chosen
    assert split_reason(chosen, stream, [], DistEnv()) == chosen  # one process reads it once


def test_a_last_batch_that_does_not_split_is_said_to_be_left_out(caplog):
    """359 samples in batches of 64 over two ranks: the last 39 do not split, and an evaluation over the split loader
    covered 320 of them, silently (documented, but nothing said it)."""
    from redline.plan import Choice
    from redline.runtime.sampling import split_reason

    data = TensorDataset(torch.arange(359.0))
    with caplog.at_level(logging.WARNING, logger="redline"):
        split = global_batches(DataLoader(data, batch_size=64), DistEnv(rank=0, world_size=2), seed=0)
    assert split is not None and split.dropped() == 39 and sum(len(batch) for batch in split) * 2 == 320
    assert "the last batch of each pass, 39 of the 359 samples, does not split evenly across the 2 processes" in (
        caplog.text
    )
    loader = DataLoader(data, batch_sampler=split)
    reason = split_reason(Choice(0, "workers 0"), loader, [], DistEnv(rank=0, world_size=2)).reason
    assert "the last 39 samples do not split across the 2 processes: left out" in reason
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="redline"):  # 360: the last 40 split, 20 a rank
        assert global_batches(DataLoader(TensorDataset(torch.arange(360.0)), batch_size=64), DistEnv(rank=0,
                              world_size=2), seed=0).dropped() == 0  # fmt: skip
    assert "does not split" not in caplog.text
