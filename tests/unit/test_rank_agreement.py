"""The Trainer's check that every rank of a launched job was given the same settings, with the other rank faked."""

import dataclasses

import pytest
import torch
from torch import nn

from redline.errors import ConfigError
from redline.parallel.env import DistEnv
from redline.task import Task
from redline.train import agreement
from redline.train.config import TrainerConfig

TWO_RANKS = DistEnv(rank=0, world_size=2, launched=True)


def rank(config: TrainerConfig, lr: float = 1e-3, width: int = 4) -> tuple:
    """What one rank's Trainer holds at set-up: its config, task, model and optimizer."""
    task = Task(
        model=nn.Linear(2, width), loss_fn=nn.functional.mse_loss, train_data=[(torch.zeros(2), torch.zeros(4))]
    )
    model = nn.Linear(2, width)
    return config, task, model, torch.optim.AdamW(model.parameters(), lr=lr)


def check_beside(monkeypatch: pytest.MonkeyPatch, mine: tuple, theirs: tuple) -> None:
    """Run rank 0's check with rank 1's settings gathered as all_gather_object would gather them."""
    monkeypatch.setattr(agreement, "gather_objects", lambda obj: [obj, agreement.settings(*theirs)])
    agreement.check_ranks_agree(*mine, TWO_RANKS)


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


def test_ranks_that_differ_only_in_what_a_host_sets_for_itself_train(monkeypatch):
    here = TrainerConfig(max_steps=60, out_dir="/mnt/a/run", progress=False)
    check_beside(monkeypatch, rank(here), rank(dataclasses.replace(here, out_dir="/shared/run", progress=True)))
    agreement.check_ranks_agree(*rank(TrainerConfig(max_steps=60)), DistEnv())  # one process: nothing gathered


def test_ranks_whose_models_keep_a_setting_of_their_own_train(monkeypatch):
    # a plain attribute a model sets per rank (its device's name, say) is no other model to agree on
    mine, theirs = rank(TrainerConfig(max_steps=60)), rank(TrainerConfig(max_steps=60))
    mine[2].device_name, theirs[2].device_name = "cuda:0", "cuda:1"
    check_beside(monkeypatch, mine, theirs)
