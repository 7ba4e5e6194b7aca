"""predict on a model that returns more than logits: a loss computed in forward beside them, as a dict, a dataclass
(Hugging Face's ModelOutput) or a namedtuple."""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import pytest
import torch
from torch import nn

import redline


@dataclasses.dataclass
class ClassifierOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class Pair(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class WithLoss(nn.Module):
    """Takes a dict of features and labels, returns its loss beside the logits (the Hugging Face pattern)."""

    returns = "dict"

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> object:
        logits = self.linear(batch["x"])
        labels = batch.get("labels")
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        if self.returns == "dataclass":
            return ClassifierOutput(loss=loss, logits=logits)
        assert loss is not None
        return Pair(loss, logits) if self.returns == "namedtuple" else {"loss": loss, "logits": logits}


def items(count: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    xs, labels = torch.randn(count, 4, generator=generator), torch.randint(0, 2, (count,), generator=generator)
    return [({"x": x, "labels": label}, label) for x, label in zip(xs, labels, strict=True)]


def with_loss_task(returns: str) -> redline.Task:
    model = type(f"WithLoss_{returns}", (WithLoss,), {"returns": returns})
    loss = (lambda out, y: out["loss"]) if returns == "dict" else (lambda out, y: out.loss)
    return redline.Task(model=model, loss_fn=loss, train_data=items(24), val_data=items(10), batch_size=4)


def quiet_config(**fields) -> redline.TrainerConfig:
    return redline.TrainerConfig(progress=False, trial="off", runtime=redline.RuntimeOptions(devices="cpu"), **fields)


@pytest.mark.parametrize("returns", ["dict", "dataclass", "namedtuple"])
def test_predict_leaves_out_a_loss_computed_in_forward_and_joins_the_logits(returns, caplog):
    """predict(val_data) refused: "the model's output['loss'] is a tensor of shape (), with no batch axis"."""
    task = with_loss_task(returns)
    with redline.Trainer(task, quiet_config(max_steps=1)) as trainer:
        trainer.fit()
        with caplog.at_level(logging.INFO, logger="redline"):
            predicted = trainer.predict(task.val_data, batch_size=4)
        assert trainer.model is not None
        with torch.no_grad():
            expected = trainer.model.linear(torch.stack([x["x"] for x, _ in task.val_data]))
    logits = predicted.logits if returns == "namedtuple" else predicted["logits"]
    torch.testing.assert_close(logits, expected)
    if returns == "namedtuple":
        assert predicted.loss is None
    else:
        assert set(predicted) == {"logits"}
    said = [r.getMessage() for r in caplog.records if "predict leaves out" in r.getMessage()]
    place = "output[0]" if returns == "namedtuple" else "output['loss']"
    assert len(said) == 1 and place in said[0], "one line for the whole call, naming the output left out"


def test_predict_collects_a_dataclass_output_without_its_fields_that_are_none():
    task = with_loss_task("dataclass")
    with redline.Trainer(task, quiet_config(max_steps=1)) as trainer:
        trainer.fit()
        predicted = trainer.predict([{"x": torch.ones(4)}] * 3, batch_size=2)  # no labels: loss=None
    assert set(predicted) == {"logits"} and predicted["logits"].shape == (3, 2)


class LossOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.linear(x).square().mean()}


def test_an_output_of_nothing_but_numbers_for_the_batch_is_refused_by_name():
    task = redline.Task(model=LossOnly, loss_fn=lambda out, y: out["loss"], train_data=[(torch.ones(4), 0)] * 4,
                        batch_size=2)  # fmt: skip
    with redline.Trainer(task, quiet_config(max_steps=1)) as trainer:
        trainer.fit()
        with pytest.raises(redline.TaskError, match=r"output\['loss'\] is a tensor of shape \(\), with no batch axis"):
            trainer.predict([torch.ones(4)], batch_size=1)
