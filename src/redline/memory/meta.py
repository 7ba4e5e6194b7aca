"""A Task's model on the meta device: every shape and dtype of the real one, and no memory.

A module given to the Task is copied with its tensors replaced by empty meta ones, never copied itself: a
model that lives on a GPU would be copied there, taking the memory being estimated. A factory's model is built
on meta by ``redline.task.meta.on_meta``, its moves to a device kept there; where it reads a tensor's value
while it builds (timm's stochastic depth: ``[x.item() for x in torch.linspace(0, rate, depth)]``), neither
meta nor fake tensors hold one, and it is built for real on the CPU and copied, as a module given is.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parameter import is_lazy
from torch.utils._pytree import tree_leaves, tree_map_only

from redline.errors import RedlineError, TrainingError, user_line
from redline.runtime.oom import is_oom
from redline.task.meta import on_meta

if TYPE_CHECKING:
    from redline.task import Task

log = logging.getLogger("redline")
_BUILT_FOR_REAL: weakref.WeakSet[Any] = weakref.WeakSet()  # the factories said to be built for real

_HELD = ("_parameters", "_buffers", "_modules")  # a module's own dicts, each tensor in them faked as what it is


def model_on_meta(task: Task) -> nn.Module:
    """The Task's model with every tensor an empty one on the meta device: the given module copied, or the
    factory's built on meta, else on fake tensors, else (it reads a tensor's value as it builds) for real on the
    CPU and copied, its weights freed once copied. Raises a TrainingError naming the user's line where the factory
    cannot build at all."""
    if isinstance(task.model, nn.Module):
        return meta_copy(task.model)
    built = on_meta(task.build_model)
    if built is not None:
        return built
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            faked = task.build_model()
        return meta_copy(faked)
    except Exception as exc:  # it reads a value fake tensors do not hold, or fails for real too (said then)
        reads_value = type(exc).__module__.startswith("torch._subclasses")  # DataDependentOutputException, ...
    if reads_value and _first_time(task.model):  # said once: a fit builds it again for each trace
        log.info(
            "task %r: its model cannot be built on the meta device or on fake tensors (its factory reads a tensor's "
            "value); building it for real on the CPU to read its shapes, which takes its weights' memory meanwhile",
            task.name,
        )
    model = built_for_real(task)  # a factory that fails for real too is reported here, with its line
    if not reads_value and _first_time(task.model):
        log.info("task %r: its model could not be built on fake tensors; it was built for real on the CPU", task.name)
    return meta_copy(model)


def _first_time(factory: object) -> bool:
    """Whether ``factory`` was not yet said to be built for real (always, for one that takes no weak reference)."""
    try:
        if factory in _BUILT_FOR_REAL:
            return False
        _BUILT_FOR_REAL.add(factory)
    except TypeError:
        pass
    return True


def built_for_real(task: Task, *, out_of_memory_passes: bool = False) -> nn.Module:
    """``task``'s model, built on the device its factory picks; a factory's error named with its line and the fix.
    ``out_of_memory_passes``: an out-of-memory error is raised as it came (the batch-size search's to handle)."""
    try:
        return task.build_model()
    except RedlineError:
        raise
    except Exception as exc:
        if out_of_memory_passes and is_oom(exc):
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        hint = "fix the factory's error (`redline train --max-steps 1` builds the model the same way)"
        if is_oom(exc):
            hint = (
                "the model does not fit this machine's memory when built for real; compute the values the factory "
                "reads in plain Python (a list, not a tensor's .item() or .tolist()), so it builds on the meta device"
            )
        raise TrainingError(
            f"task {task.name!r}: building the model failed: {type(exc).__name__}: {first}{user_line(exc)}\n"
            f"hint: {hint}"
        ) from exc


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
