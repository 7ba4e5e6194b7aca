"""The memory layout of a run's models and batches: channels_last where "auto" chose it, if the model can run so,
and following the precision the run's first steps switch to.

The rule (plan/layout.py) lays a convolutional model out channels_last for the precision it runs in: on a CPU
with AMX, bf16 convolutions want NHWC while fp32's gain nothing from it. Where the run's first steps switch
the precision (runtime/precision_check.py), the layout "auto" chose goes with it: timed in NCHW, bf16-mixed
ran the digits CNN 1.29-1.37x fp32 on such a CPU, and in NHWC 1.76-1.86x, so a check that timed bf16 in
fp32's layout would keep it at less than its speed, or miss it. The parameters, their gradients and the
optimizer's state of their shape are laid out anew between two optimizer steps, and so are the batches
the Runtime moves from then on.

A model can work in NCHW and fail in NHWC: ``x.view(len(x), -1)`` on a convolution's output, which old
tutorials write, cannot view NHWC memory. So "auto" checks its own pick: before the first forward a model runs
laid out channels_last by "auto", it runs once on copies of that forward's inputs (runtime/probe.py). Where that
fails and NCHW runs, the model goes back to NCHW for the rest of the run, the Plan says why, and the step goes
on. A layout given (``channels_last="on"``) is not checked: the forward's own error says what failed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from redline.errors import describe_error
from redline.hardware.device import DeviceFacts
from redline.plan import Choice, parse_switch
from redline.plan.layout import has_conv2d, resolve_channels_last
from redline.runtime.loading import DeviceLoader
from redline.runtime.oom import is_oom
from redline.runtime.optimizer import match_state_layout
from redline.runtime.probe import probe_forward


@dataclass
class _Laid:
    """How one set-up model is laid out."""

    channels_last: bool
    optimizer: torch.optim.Optimizer | None = None
    refused: str = ""  # why it runs NCHW where "auto" would lay it out NHWC: its forward failed so
    verified: bool = False  # a forward of it ran in NHWC: nothing to check again
    check: RemovableHandle | None = None  # the pre-hook that checks its next forward in NHWC


class Layout:
    """Whether the set-up models and the batches the Runtime moves are channels_last, as the Plan's axis says.

    ``checked``: a model "auto" lays out channels_last runs its first forward so on copies first (one process
    only: under several, each rank would decide alone), inside ``eagerly()`` (a compiled model's own forward: a
    forward without autograd would compile a graph of its own).
    """

    def __init__(
        self,
        facts: DeviceFacts,
        *,
        checked: bool = True,
        eagerly: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.facts, self.checked, self.eagerly = facts, checked, eagerly
        self.requested: str | bool = "auto"
        self.choice: Choice[bool] | None = None  # the layout now (None before a model is set up)
        self.planned: Choice[bool] | None = None  # the layout setup gave, for the precision the run began in
        self._loaders: weakref.WeakSet[DeviceLoader] = weakref.WeakSet()
        self._laid: weakref.WeakKeyDictionary[nn.Module, _Laid] = weakref.WeakKeyDictionary()

    @property
    def channels_last(self) -> bool:
        return self.choice is not None and self.choice.value

    @property
    def changed(self) -> bool:
        """Whether the layout changed since the last model was set up."""
        return self.choice is not self.planned

    def setup(self, model: nn.Module, requested: str | bool, precision: str) -> Choice[bool]:
        """Lay ``model`` out as ``requested`` ("auto": by the rule, for ``precision``); return the axis's Choice."""
        self.requested = requested
        choice = resolve_channels_last(requested, self.facts, has_conv2d=has_conv2d(model), precision=precision)
        laid = self._laid.setdefault(model, _Laid(False))
        if laid.refused and choice.value and self._auto:
            choice = Choice(False, self._refusal(choice, laid.refused))
        self._lay(model, laid, choice.value)
        self._set(choice)
        self.planned = choice
        return choice

    def adopt(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """``model``'s optimizer: its state is laid out with the model, from now on."""
        self._laid[model].optimizer = optimizer
        match_state_layout(optimizer)

    def loader(self, loader: Iterable[Any], device: torch.device) -> DeviceLoader:
        """``loader`` on ``device``, its 4-d batches laid out as the model is now and after any change."""
        moved = DeviceLoader(loader, device, channels_last=self.channels_last)
        self._loaders.add(moved)
        return moved

    def follow(self, precision: str, *, step: int) -> None:
        """Lay the set-up models (with their optimizers' state) and the loaders' batches out as the rule would for
        ``precision``, from optimizer step ``step`` on. Only "auto" follows: a layout given stays, and so does NCHW for
        a model whose forward failed in NHWC."""
        for model, laid in list(self._laid.items()):
            conv = has_conv2d(model)
            wanted = resolve_channels_last(self.requested, self.facts, has_conv2d=conv, precision=precision)
            if self.planned is None or wanted.value == laid.channels_last or laid.refused:
                continue
            self._lay(model, laid, wanted.value)
            if wanted.value == self.planned.value:
                self._set(self.planned)
            else:
                self._set(Choice(wanted.value, f"{wanted.reason}: laid out so from step {step}, with {precision}"))

    def close(self) -> None:
        """Check no forward any more (the Runtime closed)."""
        for laid in self._laid.values():
            _uncheck(laid)

    @property
    def _auto(self) -> bool:
        return parse_switch("channels_last", self.requested) is None

    def _lay(self, model: nn.Module, laid: _Laid, channels_last: bool) -> None:
        if channels_last != laid.channels_last:
            lay_out(model, laid.optimizer, channels_last=channels_last)
            laid.channels_last = channels_last
        _uncheck(laid)
        if channels_last and self._auto and self.checked and not laid.verified:
            laid.check = model.register_forward_pre_hook(self._check_forward, with_kwargs=True, prepend=True)

    def _set(self, choice: Choice[bool]) -> None:
        self.choice = choice
        for loader in self._loaders:
            loader.channels_last = choice.value

    def _check_forward(self, model: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """Before the first forward in NHWC: where it fails on copies of its inputs and runs in NCHW, lay the model
        out NCHW for good and give the forward its inputs so."""
        laid = self._laid[model]
        _uncheck(laid)
        try:
            with self.eagerly():
                probe_forward(model, args, kwargs)
            laid.verified = True
            return None
        except Exception as exc:
            if is_oom(exc):
                return None  # memory, not the layout: the forward itself meets it, where it is handled
            failed = describe_error(exc)
        lay_out(model, laid.optimizer, channels_last=False)
        args, kwargs = _nchw(args), _nchw(kwargs)
        try:
            with self.eagerly():
                probe_forward(model, args, kwargs)
        except Exception:
            lay_out(model, laid.optimizer, channels_last=True)  # it fails either way: its own error is the forward's
            return None
        laid.channels_last, laid.refused = False, failed
        if self.choice is not None and self.choice.value:
            self._set(Choice(False, self._refusal(self.choice, failed)))
        return args, kwargs

    @staticmethod
    def _refusal(choice: Choice[bool], failed: str) -> str:
        return f"{choice.reason}, but the model's forward failed so ({failed}): NCHW"


def lay_out(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, channels_last: bool) -> None:
    """Lay ``model``'s 4-d parameters, gradients and buffers out NHWC (``channels_last``) or NCHW, in place, and the
    optimizer's state of their shape with them (its momenta then match the gradients they are updated with)."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model._apply(lambda t: t.contiguous(memory_format=layout) if t.dim() == 4 else t)  # 5-d (Conv3d) kept as is
    torch.clear_autocast_cache()  # inside autocast, a weight's cast copy would keep the old layout
    if optimizer is not None:
        match_state_layout(optimizer)


def _uncheck(laid: _Laid) -> None:
    if laid.check is not None:
        laid.check.remove()
        laid.check = None


def _nchw(inputs: Any) -> Any:
    """``inputs`` with their 4-d floating-point tensors (images) laid out NCHW, as the Runtime moves batches."""
    return torch.utils._pytree.tree_map(
        lambda x: x.contiguous() if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point() else x,
        inputs,
    )
