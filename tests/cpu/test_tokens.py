"""tokens/s counts the tokens trained on: a sequence's targets, padding (-100) left out, and no image's pixels."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.bench import benchmark
from redline.runtime.contract import count_tokens
from redline.train.trainer import Trainer

VOCAB, LENGTH, REAL = 11, 8, 5  # each sequence: 5 tokens, then 3 positions of padding


@pytest.mark.parametrize(
    ("targets", "tokens"),
    [
        (torch.tensor([[1, 2, -100], [3, -100, -100]]), 3),  # a padded language model's: padding is no token
        (torch.ones(2, 4, dtype=torch.int32), 8),
        (torch.ones(2, 4, 4, dtype=torch.long), None),  # a segmentation's (batch, height, width) pixels
        (torch.ones(2, dtype=torch.long), None),  # class labels
        (torch.ones(2, 4), None),  # a regression's values
        (torch.ones(2, 4, dtype=torch.bool), None),  # multi-label flags
        ({"labels": torch.ones(2, 4, dtype=torch.long)}, None),
    ],
)
def test_the_tokens_of_a_batch_are_its_sequence_targets_not_padding(targets, tokens):
    counted = count_tokens(targets)
    assert (None if counted is None else int(counted)) == tokens


class LanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def padded_lm() -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(1, VOCAB, (32, LENGTH), generator=gen)
    y = torch.randint(1, VOCAB, (32, LENGTH), generator=gen)
    x[:, REAL:], y[:, REAL:] = 0, -100

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))  # ignore_index=-100

    return redline.Task(model=LanguageModel, loss_fn=loss_fn, train_data=TensorDataset(x, y), batch_size=8, name="lm")


def segmentation() -> redline.Task:
    images, masks = torch.randn(16, 3, 6, 6), torch.randint(0, 4, (16, 6, 6))
    model = lambda: nn.Conv2d(3, 4, 3, padding=1)  # noqa: E731
    return redline.Task(model=model, loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(images, masks),
                        batch_size=4)  # fmt: skip


def fit(task: redline.Task) -> redline.TrainSummary:
    options = redline.RuntimeOptions(devices="cpu", seed=0, precision="fp32", compile="off")
    return Trainer(task, runtime=options, max_steps=6, progress=False, trial="off").fit()


def test_a_padded_language_model_counts_its_tokens_without_the_padding():
    """8 positions a sequence were counted where 5 are tokens: tokens/s was 1.6x what the model trained on."""
    summary = fit(padded_lm())
    assert summary.tokens_per_s == pytest.approx(REAL * summary.samples_per_s)


def test_a_segmentation_reports_no_tokens():
    """Its (batch, height, width) masks were counted as tokens: 36 'tokens' an image, its pixels."""
    summary = fit(segmentation())
    assert summary.samples_per_s > 0 and summary.tokens_per_s is None


def test_the_bench_counts_tokens_as_the_trainer_does():
    result = benchmark(padded_lm(), devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2)
    for row in result.rows:
        assert not row.error and row.tokens_per_s == pytest.approx(REAL * row.samples_per_s), row.name
