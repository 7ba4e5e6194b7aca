"""A DataLoader subclass given to setup_loader is kept as given: its own __iter__ and methods are the user's code."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import redline
from redline.parallel.env import DistEnv
from redline.plan import Choice
from redline.runtime.sampling import global_batches, split_reason


class Augmenting(DataLoader):
    """A loader that changes each batch in its own __iter__ (mixup, say), and has a method of its own."""

    def __iter__(self) -> Iterator[Any]:
        for inputs, targets in super().__iter__():
            yield inputs * 0 + 100, targets

    def state_dict(self) -> dict[str, int]:
        return {"batches": 7}


def data() -> TensorDataset:
    return TensorDataset(torch.arange(8.0).unsqueeze(1), torch.arange(8))


@pytest.mark.parametrize("workers", [None, 1])
def test_a_dataloader_subclass_keeps_its_own_iter_and_methods_and_the_plan_says_why(caplog, workers):
    """It was rebuilt as a plain DataLoader: its augmentation and its state_dict were silently gone."""
    options = redline.RuntimeOptions(devices="cpu", precision="fp32", compile="off", loader_workers=workers)
    with caplog.at_level("WARNING", logger="redline"), redline.Runtime(options) as rt:
        batches = rt.setup_loader(Augmenting(data(), batch_size=4))
        assert [inputs.flatten().tolist() for inputs, _ in batches] == [[100.0] * 4] * 2
        assert batches.state_dict() == {"batches": 7}
        loader = rt.explain().loader
    assert loader is not None and loader.value.num_workers == 0
    assert loader.reason.startswith("kept as given: Augmenting is a DataLoader subclass, whose own __iter__")
    said = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    if workers is None:
        assert "not applied" not in loader.reason and not said
    else:  # asked for, and not run: said in the Plan and as a warning
        assert "loader_workers=1 not applied (Augmenting runs its own 0)" in loader.reason
        assert len(said) == 1 and said[0].startswith("loader_workers=1 is not applied to Augmenting")
        assert "hint: set num_workers on Augmenting yourself, or pass a plain DataLoader" in said[0]


def test_a_plain_dataloader_still_takes_the_workers_asked_for():
    with redline.Runtime(devices="cpu", precision="fp32", compile="off", loader_workers=1) as rt:
        batches = rt.setup_loader(DataLoader(data(), batch_size=4))
        assert batches.num_workers == 1 and [len(x) for x, _ in batches] == [4, 4]


def test_a_dataloader_subclass_under_several_processes_is_kept_whole_and_said_to_be(caplog):
    """Split across the ranks it was rebuilt, its own code lost; kept, every rank reads all of it, which is said."""
    env, chosen = DistEnv(rank=0, world_size=2, launched=True), Choice("kept", "kept as given")
    whole = Augmenting(data(), batch_size=4)
    own = Augmenting(data(), batch_size=2, sampler=DistributedSampler(data(), num_replicas=2, rank=0))
    with caplog.at_level("WARNING", logger="redline"):
        assert global_batches(whole, env, seed=0) is None and global_batches(own, env, seed=0) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("setup_loader keeps Augmenting, a DataLoader subclass, as given")
    assert "each of the 2 processes reads every batch" in said[0] and "DistributedSampler of your own" in said[0]
    assert split_reason(chosen, whole, [], env).reason.endswith(
        "not split: every rank reads every batch of Augmenting, a DataLoader subclass"
    )
    assert split_reason(chosen, own, [], env) == chosen  # its own sampler gives each rank its share
