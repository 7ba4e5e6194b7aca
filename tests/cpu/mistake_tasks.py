"""Tasks that make the mistakes newcomers make, one per ``kind``, for the CLI and the Python API tests.

redline train --task tests/cpu/mistake_tasks.py:mistake --task-arg kind=loss_per_sample
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import redline

GEN = torch.Generator().manual_seed(0)
X, Y = torch.randn(40, 4, generator=GEN), torch.randn(40, 1, generator=GEN)


class Items(Dataset):
    """40 items of whatever ``kind`` says an item is."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        if self.kind == "bare_tensor":
            return X[i]
        if self.kind == "triple":
            return X[i], Y[i], i
        if self.kind == "raises":  # a bug in the dataset's own code, met past the first item
            if i:
                raise KeyError(f"item {i} has no label")
            return X[i], Y[i]
        if self.kind == "dict_inputs":
            return {"image": X[i]}, Y[i]
        return {"x": X[i]}, {"y": Y[i], "weight": torch.ones(1)}  # dict_targets


class Stream(IterableDataset):
    """The 40 pairs as a stream: no length."""

    def __iter__(self):
        return iter(zip(X, Y, strict=True))


class NoParams(nn.Module):
    def forward(self, x):
        return x.sum(1, keepdim=True)


class BuffersOnly(nn.Module):
    """Its weight is registered as a buffer, which no optimizer steps: the module has no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.randn(4, 1))

    def forward(self, x):
        return x @ self.weight


class ListedLayers(nn.Module):
    """Layers kept in a plain list are not registered: the module has no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(4, 1)]

    def forward(self, x):
        return self.layers[0](x)


class WrongKey(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, inputs):
        return self.fc(inputs["pixels"])  # the dataset's key is "image"


class MissingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.fc(x))  # never built


class NeedsMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, mask):
        return self.fc(x * mask)


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, inputs):
        return self.fc(inputs["x"])


class BrokenInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, self.width)  # never set: a bug in the model's own constructor


class TwoOutputs(nn.Module):
    """Returns its prediction and its features, as many models do: a tuple (``as_dict``: a dict)."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.fc, self.as_dict = nn.Linear(4, 1), as_dict

    def forward(self, x):
        return {"pred": self.fc(x), "features": x} if self.as_dict else (self.fc(x), x)


def dict_loss(outputs, targets):
    return ((outputs - targets["y"]) ** 2 * targets["weight"]).mean()


def as_dict(items: list) -> dict:
    """A collate_fn that builds a dict, not an (inputs, targets) pair, from pairs."""
    return {"x": torch.stack([x for x, _ in items]), "labels": torch.stack([y for _, y in items])}


def _fields(kind: str) -> dict:
    """The Task fields that make the mistake ``kind``, over a good regression task's."""
    per_sample = lambda outputs, targets: ((outputs - targets) ** 2).squeeze(1)  # noqa: E731
    detached = lambda outputs, targets: nn.functional.mse_loss(outputs.detach(), targets)  # noqa: E731
    return {
        "ok": {},
        "bare_tensor": {"train_data": Items("bare_tensor")},
        "triple": {"train_data": Items("triple")},
        "val_triple": {"val_data": Items("triple")},
        "dict_collate": {"collate_fn": as_dict},
        "loss_per_sample": {"loss_fn": per_sample},
        "loss_number": {"loss_fn": lambda outputs, targets: 1.0},
        "loss_detached": {"loss_fn": detached},
        "metric_text": {"val_data": TensorDataset(X, Y), "metric": lambda outputs, targets: "good"},
        "no_params": {"model": NoParams},
        "listed_layers": {"model": ListedLayers},
        "buffers_only": {"model": BuffersOnly},
        "key_error": {"model": WrongKey, "train_data": Items("dict_inputs")},
        "attribute_error": {"model": MissingLayer},
        "type_error": {"model": NeedsMask},
        "tuple_outputs": {"model": TwoOutputs},
        "dict_outputs": {"model": lambda: TwoOutputs(as_dict=True), "val_data": TensorDataset(X, Y)},
        "broken_init": {"model": BrokenInit},
        "dataset_error": {"train_data": Items("raises")},
        "val_dataset_error": {"val_data": Items("raises")},
        "short": {"train_data": TensorDataset(X[:1], Y[:1]), "batch_size": 2},
        "stream": {"train_data": Stream()},
        "dict_targets": {"model": DictModel, "loss_fn": dict_loss, "train_data": Items("dict_targets")},
    }[kind]


def mistake(kind: str = "ok", hidden: int = 1) -> redline.Task:
    """A small regression Task with the mistake ``kind`` made (``ok``: none)."""
    fields: dict = {
        "model": lambda: nn.Linear(4, hidden),
        "loss_fn": nn.functional.mse_loss,
        "train_data": TensorDataset(X, Y),
        "batch_size": 8,
        "name": kind,
    }
    return redline.Task(**{**fields, **_fields(kind)})
