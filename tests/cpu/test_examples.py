"""The built-in examples load by spec, honour their options, and learn what they promise on a CPU."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from redline.errors import ConfigError, TaskSpecError
from redline.examples.chargpt import NOT_FINITE, SAMPLE_CHARS, SAMPLE_PROMPT, stdlib_docstrings
from redline.examples.gpt import GPT
from redline.task import Task, load_task

# A chargpt small enough that 100 steps take about a second on two cores (88 steps an epoch).
TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 64, "block_size": 32, "max_chars": 100_000, "epochs": 2}


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def train_plainly(task: Task, model: nn.Module, *, max_steps: int | None = None, seed: int = 0) -> list[float]:
    """Train the way a user's own loop would: shuffled DataLoader, the task's loss and optimizer."""
    optimizer = task.optimizer(model.parameters())
    loader = DataLoader(
        task.train_data, batch_size=task.batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    losses: list[float] = []
    model.train()
    for _ in range(task.epochs):
        for inputs, targets in loader:
            loss = task.loss_fn(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if max_steps is not None and len(losses) == max_steps:
                return losses
    return losses


def mean_val_loss(task: Task, model: nn.Module) -> float:
    assert task.val_data is not None
    model.eval()
    with torch.no_grad():
        losses = [task.loss_fn(model(x), y).item() for x, y in DataLoader(task.val_data, batch_size=64)]
    return sum(losses) / len(losses)


def test_digits_data_is_all_1797_images_split_by_seed() -> None:
    task = load_task("example:digits")
    assert task.name == "digits" and task.epochs == 15 and task.metric is not None
    assert task.val_data is not None
    assert len(task.train_data) + len(task.val_data) == 1797  # type: ignore[arg-type]
    assert len(task.val_data) == round(0.2 * 1797)  # type: ignore[arg-type]
    images, labels = task.train_data.tensors  # type: ignore[attr-defined]
    assert images.shape[1:] == (1, 8, 8) and images.dtype == torch.float32
    assert images.min() == 0.0 and images.max() == 1.0
    assert labels.dtype == torch.int64 and set(labels.tolist()) == set(range(10))

    again = load_task("example:digits").train_data.tensors[0]  # type: ignore[attr-defined]
    other = load_task("example:digits", seed=1).train_data.tensors[0]  # type: ignore[attr-defined]
    assert torch.equal(images, again)
    assert not torch.equal(images, other)


def test_digits_options_reach_the_model_and_the_split() -> None:
    narrow = load_task("example:digits", width=8, val_fraction=0.5, batch_size=16)
    assert num_params(narrow.build_model()) < num_params(load_task("example:digits").build_model())
    assert len(narrow.val_data) == round(0.5 * 1797)  # type: ignore[arg-type]
    assert narrow.batch_size == 16


def test_digits_reaches_95_percent_in_its_default_epochs() -> None:
    task = load_task("example:digits")
    torch.manual_seed(0)
    model = task.build_model()
    train_plainly(task, model)
    images, labels = task.val_data.tensors  # type: ignore[union-attr]
    model.eval()
    with torch.no_grad():
        accuracy = task.metric(model(images), labels)  # type: ignore[misc]
    assert isinstance(accuracy, float)
    assert accuracy >= 0.95


def test_chargpt_blocks_are_shifted_and_do_not_overlap() -> None:
    task = load_task("example:chargpt", block_size=16, max_chars=20_000)
    assert task.name == "chargpt" and task.metric is None and task.val_data is not None
    (x0, y0), (x1, _) = task.train_data[0], task.train_data[1]
    assert x0.shape == y0.shape == (16,) and x0.dtype == y0.dtype == torch.long
    assert torch.equal(x0[1:], y0[:-1])
    assert x1[0] == y0[-1]  # block 1 starts where block 0's targets end
    # First 90% / last 10% of 20,000 characters; each block needs block_size + 1 of them.
    assert len(task.train_data) == (18_000 - 1) // 16  # type: ignore[arg-type]
    assert len(task.val_data) == (2_000 - 1) // 16  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        task.train_data[len(task.train_data)]  # type: ignore[arg-type]


def test_chargpt_corpus_is_real_deterministic_text() -> None:
    text = stdlib_docstrings()
    stdlib_docstrings.cache_clear()
    assert stdlib_docstrings() == text
    assert len(text) > 100_000 and "Return the " in text
    vocab = load_task("example:chargpt", max_chars=20_000).sample.vocab  # type: ignore[union-attr]
    assert vocab.chars == "".join(sorted(set(text[:20_000] + SAMPLE_PROMPT)))
    assert vocab.decode(vocab.encode("def f(x):\n")) == "def f(x):\n"


def test_chargpt_options_reach_the_model() -> None:
    default = load_task("example:chargpt").build_model()
    shallow = load_task("example:chargpt", n_layer=1).build_model()
    assert num_params(shallow) < num_params(default)
    longer = load_task("example:chargpt", block_size=128, n_embd=64, n_head=2).build_model()
    assert isinstance(longer, GPT)
    assert longer.wpe.weight.shape == (128, 64)
    assert longer.lm_head.weight is longer.wte.weight  # the lm head is tied to the token embedding


def test_chargpt_loss_drops_in_100_steps_and_it_samples() -> None:
    task = load_task("example:chargpt", **TINY_GPT)
    torch.manual_seed(0)
    model = task.build_model()
    vocab_size = task.sample.vocab.size  # type: ignore[union-attr]
    before = mean_val_loss(task, model)
    assert before == pytest.approx(math.log(vocab_size), abs=0.2)  # an untrained model guesses uniformly

    losses = train_plainly(task, model, max_steps=100)
    assert len(losses) == 100
    assert mean_val_loss(task, model) < before - 1.0

    model.train()
    text = task.sample(model)  # type: ignore[misc]
    assert isinstance(text, str) and len(text) == len(SAMPLE_PROMPT) + SAMPLE_CHARS
    assert text.startswith(SAMPLE_PROMPT)
    assert model.training, "sample must restore the model's training mode"
    assert task.sample(model) == text  # type: ignore[misc]  # a fixed seed gives a fixed sample


def test_chargpt_sample_of_a_diverged_model_says_so_instead_of_raising() -> None:
    task = load_task("example:chargpt", **TINY_GPT)
    model = task.build_model()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))  # what a step with a far too large lr leaves
    text = task.sample(model)  # type: ignore[misc]
    assert text == SAMPLE_PROMPT + NOT_FINITE
    assert "NaN or inf" in text


@pytest.mark.parametrize(
    ("spec", "options", "named"),
    [
        ("example:digits", {"val_fraction": 0.0}, "val_fraction"),
        ("example:digits", {"val_fraction": 1.0}, "val_fraction"),
        ("example:digits", {"val_fraction": float("nan")}, "val_fraction"),
        ("example:digits", {"width": 0}, "width"),
        ("example:digits", {"lr": -1e-3}, "lr"),
        ("example:digits", {"lr": float("inf")}, "lr=inf is not allowed; expected a finite number > 0"),
        ("example:chargpt", {"lr": float("inf")}, "lr=inf is not allowed; expected a finite number > 0"),
        ("example:chargpt", {"lr": float("nan")}, "lr=nan"),
        ("example:digits", {"batch_size": 0}, "batch_size"),
        ("example:digits", {"depth": 3}, "depth"),
        ("example:chargpt", {"n_embd": 100, "n_head": 3}, "n_embd"),
        ("example:chargpt", {"n_layer": 0}, "n_layer"),
        ("example:chargpt", {"dropout": 1.0}, "dropout"),
        ("example:chargpt", {"block_size": 0}, "block_size"),
        ("example:chargpt", {"max_chars": 100}, "max_chars"),
        ("example:chargpt", {"epochs": 0}, "epochs"),
    ],
)
def test_bad_options_are_refused_by_name(spec: str, options: dict[str, object], named: str) -> None:
    with pytest.raises((ConfigError, TaskSpecError), match=named):
        load_task(spec, **options)
