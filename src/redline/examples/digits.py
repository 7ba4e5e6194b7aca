"""``example:digits``: a small CNN that classifies the 8x8 handwritten digits shipped in ``data/``.

The data (1,797 images, UCI "Optical Recognition of Handwritten Digits", CC BY 4.0) is described in
``data/DIGITS-LICENSE.md``. It is read with NumPy from the package; nothing is downloaded.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.optim.optimizer import ParamsT
from torch.utils.data import TensorDataset

from redline.config import positive_int
from redline.errors import invalid
from redline.task import Task

DATA_FILE = Path(__file__).parent / "data" / "digits.npz"
NUM_CLASSES = 10


def digits(
    *,
    batch_size: int = 64,
    epochs: int = 15,
    lr: float = 3e-3,
    width: int = 32,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> Task:
    """Return the digits Task: 10-way classification of 8x8 images, metric = validation accuracy.

    With the defaults, plain fp32 training reaches at least 95% validation accuracy in a few seconds
    on a CPU. ``seed`` fixes the train/val split; the model factory seeds nothing.
    """
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise invalid("lr", lr, "a finite number > 0", "the default, 3e-3, reaches 95% in 15 epochs")
    positive_int("width", width)  # channels of the first conv layer
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise invalid("seed", seed, "an integer")
    images, labels = load_digits()
    total = len(labels)
    n_val = _val_count(val_fraction, total)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    val_idx, train_idx = order[:n_val], order[n_val:]

    def optimizer(params: ParamsT) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr)

    return Task(
        model=functools.partial(DigitsCNN, width=width),
        loss_fn=nn.CrossEntropyLoss(),
        train_data=TensorDataset(images[train_idx], labels[train_idx]),
        val_data=TensorDataset(images[val_idx], labels[val_idx]),
        optimizer=optimizer,
        batch_size=batch_size,
        metric=accuracy,
        epochs=epochs,
        name="digits",
    )


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Return all 1,797 images as float32 (N, 1, 8, 8) scaled to [0, 1], and their int64 labels."""
    with np.load(DATA_FILE) as data:
        images, labels = data["images"], data["labels"]
    # Pixels count the "on" cells of a 4x4 block of the original 32x32 bitmap, so they run 0..16.
    pixels = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    return pixels, torch.from_numpy(labels.astype(np.int64))


def _val_count(val_fraction: float, total: int) -> int:
    allowed = f"a fraction in (0, 1) that leaves both splits at least one of the {total:,} images"
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise invalid("val_fraction", val_fraction, allowed)
    # The comparison also rejects NaN.
    n_val = round(total * val_fraction) if 0 < val_fraction < 1 else 0
    if not 0 < n_val < total:
        raise invalid("val_fraction", val_fraction, allowed, "0.2 holds out 359 images")
    return n_val


class DigitsCNN(nn.Module):
    """Two 3x3 conv layers, a 2x2 max-pool and a linear head: (N, 1, 8, 8) -> logits (N, 10)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Linear(2 * width * 4 * 4, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.features(x).flatten(1))
        return logits


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Return the fraction of rows whose highest logit is the label."""
    return (logits.argmax(dim=-1) == labels).float().mean().item()
