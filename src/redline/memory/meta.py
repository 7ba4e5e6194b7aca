"""A Task's model on the meta device: every shape and dtype of the real one, and no memory.

A module given to the Task is copied with its tensors replaced by empty meta ones, never copied itself: a
model that lives on a GPU would be copied there, taking the memory being estimated. A factory's model is built
on meta by ``redline.task.meta.on_meta``, its moves to a device kept there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parameter import is_lazy
from torch.utils._pytree import tree_leaves, tree_map_only

_HELD = ("_parameters", "_buffers", "_modules")  # a module's own dicts, each tensor in them faked as what it is


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose tensors (parameters, buffers, plain tensor attributes) are empty ones on the
    meta device, tied weights still tied; ``model`` and its weights are left as they are and not copied."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        held = [leaf for value in vars(module).values() for leaf in held_tensors(value)]  # a list or dict of them
        for tensor in [*module._parameters.values(), *module._buffers.values(), *vars(module).values(), *held]:
            if not isinstance(tensor, torch.Tensor) or id(tensor) in memo or is_lazy(tensor):
                continue
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def held_tensors(value: object) -> list[torch.Tensor]:
    """The tensors a list, tuple or dict attribute of a module holds (constants kept beside the registered ones)."""
    if not isinstance(value, list | tuple | dict):
        return []
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def fake_model(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """``model`` (a copy of the Task's module, or the factory's built on the meta device) with its tensors
    replaced by fake ones on the CPU; call it under ``mode``.

    A factory is not run under the fake mode itself: a module's ``.to(dtype)``, ``.half()`` or ``.float()``
    cannot swap a fake parameter for its converted copy (torch holds a weak reference to it), while on
    the meta device they work, and the model is the same, shape for shape and dtype for dtype."""

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta:  # no values to copy: an empty tensor of its size, stride and dtype
            return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="cpu")
        return mode.from_tensor(tensor)

    memo = swap_tensors(model, fake)
    for module in model.modules():
        for name, value in list(vars(module).items()):  # a plain tensor attribute (a mask kept unregistered)
            if isinstance(value, torch.Tensor):
                setattr(module, name, _once(memo, value, fake))
            elif name not in _HELD and held_tensors(value):  # constants kept in a list or a dict
                faked = tree_map_only(torch.Tensor, lambda t: _once(memo, t, fake, isinstance(t, nn.Parameter)), value)
                setattr(module, name, faked)
    return model


def swap_tensors(model: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor | None]) -> dict[int, torch.Tensor]:
    """Replace every module's parameters and buffers by ``convert``'s copy of each (None keeps one as it is), once
    per tensor so tied weights stay one; a parameter stays a parameter. Returns the replacements by the original's id.

    ``Module.to`` cannot do this for fake tensors: torch holds a weak reference to each parameter it swaps."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for held, parameters in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in list(held.items()):
                if tensor is not None:
                    held[name] = _once(memo, tensor, convert, parameters)  # type: ignore[assignment]
    return memo


def _once(
    memo: dict[int, torch.Tensor],
    tensor: torch.Tensor,
    convert: Callable[[torch.Tensor], torch.Tensor | None],
    parameter: bool = False,
) -> torch.Tensor:
    if id(tensor) not in memo:
        copied = convert(tensor)
        if copied is None:
            memo[id(tensor)] = tensor
        else:
            memo[id(tensor)] = nn.Parameter(copied, tensor.requires_grad) if parameter else copied
    return memo[id(tensor)]
