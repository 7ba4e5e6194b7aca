"""Wrapping a model for its strategy, and reaching the user's model inside a wrapper."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def wrap_ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    """Replicate ``model`` with DDP: rank 0's weights are broadcast, gradients all-reduced in backward."""
    device_ids = [device.index] if device.type == "cuda" and device.index is not None else None
    return DistributedDataParallel(model, device_ids=device_ids)


def unwrap(model: nn.Module) -> nn.Module:
    """Return the user's module inside a DDP wrapper (names without the ``module.`` prefix)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Return the context for a backward that does (or, mid-accumulation, does not) all-reduce gradients."""
    if enabled:
        return contextlib.nullcontext()
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    setter = getattr(model, "set_requires_gradient_sync", None)  # an FSDP2 module
    if setter is not None:
        setter(False)
        return _ReenableSync(model)
    return contextlib.nullcontext()


class _ReenableSync(contextlib.AbstractContextManager[None]):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __exit__(self, *exc: object) -> None:
        self.model.set_requires_gradient_sync(True)  # type: ignore[operator]
