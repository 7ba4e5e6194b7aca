"""How estimate_memory builds a factory's model: on meta, on fake tensors, or for real where it reads a value."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.errors import TrainingError
from redline.memory.estimate import estimate_memory
from redline.memory.fit import fit_memory
from redline.task import Task


class DropPathNet(nn.Module):
    """timm's stochastic depth: its rates read with .item() while it builds, which meta and fake tensors refuse."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.rates = [x.item() for x in torch.linspace(0, 0.1, depth)]
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in self.rates)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class FailsToBuild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        width = int(torch.tensor(64).item())
        self.linear = nn.Linear(width, 10)
        raise ValueError("no such checkpoint")  # a mistake of the factory's own, which a real build meets too


def task_of(model: object) -> Task:
    data = TensorDataset(torch.randn(128, 64), torch.randint(0, 10, (128,)))
    return Task(model=model, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=16, name="droppath")


def test_a_factory_that_reads_a_value_as_it_builds_is_estimated_as_its_module_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, it failed as 'a training step could not be traced on fake tensors', though its module estimated."""
    given = estimate_memory(task_of(DropPathNet()), target="cpu")
    with caplog.at_level(logging.INFO, logger="redline"):
        built = estimate_memory(task_of(DropPathNet), target="cpu")
    assert built == given
    assert "building it for real on the CPU" in caplog.text  # the host memory it takes meanwhile is said


def test_a_factory_that_reads_a_value_is_structured_for_accumulation_and_the_fit() -> None:
    given = estimate_memory(task_of(DropPathNet()), target="cpu", grad_accum=2)
    assert estimate_memory(task_of(DropPathNet), target="cpu", grad_accum=2) == given
    fit = fit_memory(task_of(DropPathNet), device="a CPU", target="cpu", mem_gib=1.0)
    assert [row.label for row in fit.rows] == ["as it stands", "activation checkpointing"]  # its blocks were found


def test_a_factory_that_cannot_be_built_at_all_says_building_failed_with_its_line() -> None:
    with pytest.raises(TrainingError) as caught:
        estimate_memory(task_of(FailsToBuild), target="cpu")
    message = str(caught.value)
    assert message.startswith("task 'droppath': building the model failed: ValueError: no such checkpoint\n  at ")
    assert 'in __init__: raise ValueError("no such checkpoint")' in message
    assert "fake tensors" not in message


class MissingFile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise FileNotFoundError("weights.pt")  # no value read: meta and fake tensors fail as the real build does


def test_a_factory_failing_for_its_own_reason_is_not_said_to_read_a_value(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="redline"), pytest.raises(TrainingError) as caught:
        estimate_memory(task_of(MissingFile), target="cpu")
    assert str(caught.value).startswith("task 'droppath': building the model failed: FileNotFoundError: weights.pt")
    assert "reads a tensor's value" not in caplog.text and "built for real" not in caplog.text


def test_the_measured_search_says_a_factorys_error_as_the_estimate_does() -> None:
    from redline import RuntimeOptions, find_batch_size

    with pytest.raises(TrainingError) as caught:
        find_batch_size(task_of(MissingFile), options=RuntimeOptions(devices="cpu", precision="fp32"), max_batch_size=2)
    message = str(caught.value)
    assert message.startswith("task 'droppath': building the model failed: FileNotFoundError: weights.pt")
    assert "hint: fix the factory's error (`redline train --max-steps 1` builds the model the same way)" in message
