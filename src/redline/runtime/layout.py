"""The memory layout of a run's model and batches, and a layout that follows the precision the run switches to.

The rule (plan/layout.py) lays a convolutional model out channels_last for the precision it runs in: on a CPU
with AMX, bf16 convolutions want NHWC while fp32's gain nothing from it. Where the run's first steps switch
the precision (runtime/precision_check.py), the layout "auto" chose goes with it: timed in NCHW, bf16-mixed
ran the digits CNN 1.29-1.37x fp32 on such a CPU, and in NHWC 1.76-1.86x, so a check that timed bf16 in
fp32's layout would keep it at less than its speed, or miss it. The parameters, their gradients and the
optimizer's state of their shape are laid out anew between two optimizer steps, and so are the batches
the Runtime moves from then on.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from redline.hardware.device import DeviceFacts
from redline.plan import Choice
from redline.plan.layout import has_conv2d, resolve_channels_last
from redline.runtime.loading import DeviceLoader


class Layout:
    """Whether the set-up model and the batches the Runtime moves are channels_last, as the Plan's axis says."""

    def __init__(self, facts: DeviceFacts) -> None:
        self.facts = facts
        self.requested: str | bool = "auto"
        self.choice: Choice[bool] | None = None  # the layout now (None before a model is set up)
        self.planned: Choice[bool] | None = None  # the layout setup gave, for the precision the run began in
        self._loaders: weakref.WeakSet[DeviceLoader] = weakref.WeakSet()
        self._laid: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()  # each model: NHWC?

    @property
    def channels_last(self) -> bool:
        return self.choice is not None and self.choice.value

    def setup(self, model: nn.Module, requested: str | bool, precision: str) -> Choice[bool]:
        """Lay ``model`` out as ``requested`` ("auto": by the rule, for ``precision``); return the axis's Choice."""
        self.requested = requested
        choice = resolve_channels_last(requested, self.facts, has_conv2d=has_conv2d(model), precision=precision)
        if choice.value:
            model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.choice = self.planned = choice
        self._laid[model] = choice.value
        return choice

    def loader(self, loader: Iterable[Any], device: torch.device) -> DeviceLoader:
        """``loader`` on ``device``, its 4-d batches laid out as the model is now and after any change."""
        moved = DeviceLoader(loader, device, channels_last=self.channels_last)
        self._loaders.add(moved)
        return moved

    def follow(
        self, precision: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, step: int
    ) -> Choice[bool] | None:
        """Lay ``model`` (with its optimizer's state) and the loaders' batches out as the rule would for ``precision``,
        from optimizer step ``step`` on; return the axis's Choice now. Only "auto" follows: a layout given stays."""
        laid = self._laid.get(model)
        wanted = resolve_channels_last(self.requested, self.facts, has_conv2d=has_conv2d(model), precision=precision)
        if laid is None or self.planned is None or wanted.value == laid:
            return self.choice
        lay_out(model, optimizer, channels_last=wanted.value)
        self._laid[model] = wanted.value
        for loader in self._loaders:
            loader.channels_last = wanted.value
        if wanted.value == self.planned.value:
            self.choice = self.planned
        else:
            self.choice = Choice(wanted.value, f"{wanted.reason}: laid out so from step {step}, with {precision}")
        return self.choice


def lay_out(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, channels_last: bool) -> None:
    """Lay ``model``'s 4-d parameters, gradients and buffers out NHWC (``channels_last``) or NCHW, in place, and the
    optimizer's state of their shape with them (its momenta then match the gradients they are updated with)."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model.to(memory_format=layout)  # type: ignore[call-overload]
    if optimizer is None:
        return
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape == param.shape:
                state[key] = value.contiguous(memory_format=layout)
