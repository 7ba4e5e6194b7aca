"""The model a checkpoint holds, by name and shape, against the model it is about to be loaded into.

Both formats list their tensors without reading them (safetensors' header, DCP's metadata), so a
checkpoint of another model is refused before loading, with a few of the names that differ, where
torch's loader would list every key of both models.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from redline.checkpoint.layout import CheckpointError
from redline.errors import few

Shapes = dict[str, tuple[int, ...]]
SHOWN = 3  # names shown for each kind of difference; the rest are counted


def shapes_of(state: Mapping[str, Any]) -> Shapes:
    """Return the shapes of a state dict's tensors by name (a sharded tensor's whole shape)."""
    return {name: tuple(value.shape) for name, value in state.items() if isinstance(value, torch.Tensor)}


def safetensors_shapes(path: Path) -> Shapes:
    """Return a safetensors file's tensor shapes by name from its header, a tied weight under each name."""
    with safe_open(path, framework="pt") as weights:
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118 (not a dict)
        aliases = weights.metadata() or {}  # {dropped name: kept name} of tied weights, and "format"
    shapes.update({alias: shapes[kept] for alias, kept in aliases.items() if kept in shapes})
    return shapes


class ModelMismatch(CheckpointError):
    """A checkpoint of another model than the one it is loaded into (by its tensors' names and shapes)."""


def check_same_model(path: Path, saved: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ModelMismatch naming a few differences if the checkpoint's shapes ``saved`` are not the model's."""
    found = differences(saved, expected)
    if found:
        raise ModelMismatch(
            f"{path}: the checkpoint's model differs from this run's model: {'; '.join(found)}\n"
            "hint: this run's model is not the one that wrote the checkpoint (another --task-arg, or changed model "
            "code, changes its shapes): resume with the same --task-arg values as the run that wrote it, or load a "
            "checkpoint of this model (redline train: --resume one of this model, or another --out)"
        )


def differences(saved: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Name a few of the tensors missing from ``saved``, extra in it, or of another shape than ``expected``'s."""
    missing = [name for name in expected if name not in saved]  # in the model's order, then the checkpoint's
    unexpected = [name for name in saved if name not in expected]
    resized = [
        f"{name} ({_shape(saved[name])} in the checkpoint, {_shape(shape)} in this model)"
        for name, shape in expected.items()
        if name in saved and tuple(saved[name]) != tuple(shape)
    ]
    kinds = [("missing from the checkpoint", missing), ("not in this model", unexpected), ("shapes differ", resized)]
    return [f"{kind}: {few(names, SHOWN)}" for kind, names in kinds if names]


def _shape(shape: tuple[int, ...]) -> str:
    return f"[{', '.join(map(str, shape))}]"
