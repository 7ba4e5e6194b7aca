"""The Trainer's check that every rank of a launched job was given the same settings, with the other rank faked."""

import copy
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset, random_split

from redline.errors import ConfigError
from redline.parallel.env import DistEnv
from redline.runtime.options import RuntimeOptions
from redline.task import Task
from redline.train import agreement
from redline.train.config import TrainerConfig

TWO_RANKS = DistEnv(rank=0, world_size=2, launched=True)


def rank(config: TrainerConfig, lr: float = 1e-3, width: int = 4, **data: Any) -> tuple:
    """What one rank's Trainer holds at set-up: its config, task (with ``data``'s sets), model and optimizer."""
    sets = {"train_data": [(torch.zeros(2), torch.zeros(4))], **data}
    task = Task(model=nn.Linear(2, width), loss_fn=nn.functional.mse_loss, **sets)
    model = nn.Linear(2, width)
    return config, task, model, torch.optim.AdamW(model.parameters(), lr=lr)


def check_beside(
    monkeypatch: pytest.MonkeyPatch, mine: tuple, theirs: tuple, launched: dict[str, str] | None = None
) -> None:
    """Run rank 0's checks with rank 1's settings gathered as all_gather_object would gather them (``launched``:
    rank 1's launcher's flags, as rank 0's where not given)."""
    launched = agreement.launch_settings(TWO_RANKS) if launched is None else launched
    gathered = iter([agreement.settings(*theirs[:3]) | launched, agreement.optimizer_settings(theirs[3])])
    monkeypatch.setattr(agreement, "gather_objects", lambda obj: [obj, next(gathered)])
    agreement.check_ranks_agree(*mine[:3], TWO_RANKS)
    agreement.check_optimizers_agree(mine[3], TWO_RANKS)


@pytest.mark.parametrize(
    ("other", "named"),
    [
        ({"config": TrainerConfig(max_steps=40)}, "max_steps is 60 on rank 0 and 40 on rank 1"),
        ({"lr": 0.01}, "the optimizer's lr (group 0) is 0.001 on rank 0 and 0.01 on rank 1"),
        ({"width": 8}, "model (structure and shapes) is "),
    ],
)
def test_a_rank_given_other_settings_is_refused_naming_the_setting_and_both_values(monkeypatch, other, named):
    """Node 1 started with --max-steps 40 where node 0 had 60 waited at the end for gloo's 30-minute timeout; another
    --task-arg lr= trained each rank apart and exited 0."""
    with pytest.raises(ConfigError, match="the ranks of this job were given different settings") as refused:
        check_beside(
            monkeypatch, rank(TrainerConfig(max_steps=60)), rank(**{"config": TrainerConfig(max_steps=60), **other})
        )
    assert named in str(refused.value) and "hint: start every node with the same arguments" in str(refused.value)


@pytest.mark.parametrize(
    ("theirs", "environ", "named"),
    [
        (60.0, {"GROUP_WORLD_SIZE": "2"}, "the launcher's --hang-timeout is none on rank 0 and 60 on rank 1"),
        (None, {"GROUP_WORLD_SIZE": "3"}, "the launcher's --nnodes is 2 on rank 0 and 3 on rank 1"),
    ],
)
def test_machines_whose_launchers_were_given_other_flags_are_refused_naming_both(monkeypatch, theirs, environ, named):
    """Before, --hang-timeout on node 0 alone had its watchdog report that rank 1 never started one while rank 1
    trained; a node started with --nnodes 3 joined a job of 2 without a word."""
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    launched = agreement.launch_settings(dataclasses.replace(TWO_RANKS, rank=1, hang_timeout_s=theirs), environ)
    config = TrainerConfig(max_steps=60)
    with pytest.raises(ConfigError, match="the ranks of this job were given different settings") as refused:
        check_beside(monkeypatch, rank(config), rank(config), launched)
    assert named in str(refused.value)


def test_ranks_that_differ_only_in_what_a_host_sets_for_itself_train(monkeypatch):
    here = TrainerConfig(max_steps=60, out_dir="/mnt/a/run", progress=False)
    check_beside(monkeypatch, rank(here), rank(dataclasses.replace(here, out_dir="/shared/run", progress=True)))
    agreement.check_ranks_agree(*rank(TrainerConfig(max_steps=60))[:3], DistEnv())  # one process: nothing gathered


def test_ranks_given_the_default_number_of_checkpoints_in_two_spellings_train(monkeypatch):
    # --keep-checkpoints 3 typed on one node, left out on the other: both keep 3
    left_out, typed = TrainerConfig(out_dir="/run"), TrainerConfig(out_dir="/run", keep_checkpoints=3)
    check_beside(monkeypatch, rank(left_out), rank(typed))
    with pytest.raises(ConfigError, match="keep_checkpoints is 3 on rank 0 and 2 on rank 1"):
        check_beside(monkeypatch, rank(left_out), rank(TrainerConfig(out_dir="/run", keep_checkpoints=2)))


def test_ranks_that_differ_in_giving_grad_accum_its_default_are_refused_by_the_option_not_its_record(monkeypatch):
    # --grad-accum 1 on one node wins over a tune the other node runs; the refusal named the internal record:
    # "runtime.left_out is ('compile_mode', 'grad_accum') on rank 0 and ('compile_mode',) on rank 1"
    given = TrainerConfig(max_steps=60, runtime=RuntimeOptions(grad_accum=1))
    with pytest.raises(ConfigError, match="the ranks of this job were given different settings") as refused:
        check_beside(monkeypatch, rank(TrainerConfig(max_steps=60)), rank(given))
    assert "runtime.grad_accum is 1 (left out) on rank 0 and 1 (given) on rank 1" in str(refused.value)
    assert "left_out" not in str(refused.value) and "compile_mode" not in str(refused.value)
    check_beside(monkeypatch, rank(given), rank(given))
    two = TrainerConfig(max_steps=60, runtime=RuntimeOptions(grad_accum=2))
    with pytest.raises(ConfigError, match=r"runtime\.grad_accum is 2 on rank 0 and 1 \(left out\) on rank 1"):
        check_beside(monkeypatch, rank(two), rank(TrainerConfig(max_steps=60)))


def test_ranks_whose_models_keep_a_setting_of_their_own_train(monkeypatch):
    # a plain attribute a model sets per rank (its device's name, say) is no other model to agree on
    mine, theirs = rank(TrainerConfig(max_steps=60)), rank(TrainerConfig(max_steps=60))
    mine[2].device_name, theirs[2].device_name = "cuda:0", "cuda:1"
    check_beside(monkeypatch, mine, theirs)


def digits_like(seed: int, n_val: int, size: int = 20) -> dict:
    """The sets of a task that splits ``size`` samples in memory by a seeded permutation, as digits does."""
    images, labels = torch.arange(size * 2.0).reshape(size, 2), torch.arange(size * 4.0).reshape(size, 4)
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    train, val = order[n_val:], order[:n_val]
    return {
        "train_data": TensorDataset(images[train], labels[train]),
        "val_data": TensorDataset(images[val], labels[val]),
    }


@pytest.mark.parametrize(
    ("theirs", "named"),
    [
        # --task-arg val_fraction=0.25 on one node, 0.2 on the other: trained 22 steps, then a collective mismatch
        (digits_like(seed=0, n_val=5), "the task's train_data (its length) is 16 on rank 0 and 15 on rank 1"),
        # a split seeded by the rank: each rank validated on samples the other trained on, and exited 0
        (digits_like(seed=1, n_val=4), "the task's train_data (a hash of a few of its items) is "),
    ],
)
def test_ranks_given_other_data_are_refused_naming_the_set(monkeypatch, theirs, named):
    mine = rank(TrainerConfig(max_steps=60), **digits_like(seed=0, n_val=4))
    with pytest.raises(ConfigError, match="the ranks of this job were given different settings") as refused:
        check_beside(monkeypatch, mine, rank(TrainerConfig(max_steps=60), **theirs))
    assert named in str(refused.value) and "a split seeded by the rank differs" in str(refused.value)
    assert "data drawn at random in the task's factory needs `redline train --seed N`" in str(refused.value)


class Augmented(Dataset):
    """Items drawn at random on each read, as a random augmentation draws them: not read to compare."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple:
        return torch.rand(2), torch.zeros(4)


def test_ranks_whose_data_is_the_same_train_though_random_reads_or_devices_differ(monkeypatch):
    config = TrainerConfig(max_steps=60)
    check_beside(monkeypatch, rank(config, **digits_like(0, 4)), rank(config, **digits_like(0, 4)))
    check_beside(monkeypatch, rank(config, train_data=Augmented()), rank(config, train_data=Augmented()))
    assert agreement.items_digest(Augmented()) is None
    # a random_split of a dataset that is not read: the same split is the same indices, another split is not
    split = [random_split(Augmented(), [6, 2], torch.Generator().manual_seed(seed))[0] for seed in (0, 0, 1)]
    assert agreement.items_digest(split[0]) == agreement.items_digest(split[1]) != agreement.items_digest(split[2])
    # items of plain kinds (dicts of arrays, texts) are read; an object whose repr holds its address is not
    items = [{"x": np.ones(2), "name": "a"}]
    assert agreement.items_digest(items) == agreement.items_digest(copy.deepcopy(items)) is not None
    assert agreement.items_digest([(torch.zeros(2), object())]) is None
