"""A forward that leaves no trace: on copies of the inputs, without autograd, the random streams and buffers put back.

The run's first steps check what "auto" chose by running the model once more on a step's own inputs before that
step's forward (runtime/precision_check.py: the other precision; runtime/layout.py: a channels_last layout). The
step's own forward then runs as if the check had not: dropout draws the same mask, BatchNorm's running statistics
move once, a tensor the model keeps in an attribute (a recurrent state, ``self.h = h.detach()``) is the step's own
again, and a forward that changes its inputs in place changes copies. What a forward does besides computing (a call
counter, a hook of the user's, a tensor attribute changed in place) happens at the check too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from redline.runtime.seed import capture_rng, restore_rng
from redline.runtime.transfer import map_tensors


@contextlib.contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """Put ``module``'s buffers (BatchNorm's running statistics) back as they were after the forwards inside: each the
    same tensor with the same values, also where a forward assigned a new one (``self.seen = self.seen + 1``), filled
    one registered as None, or registered one."""
    owners = list(module.modules())
    present = [(owner, set(owner._buffers)) for owner in owners]
    saved = [
        (owner, name, buffer, None if buffer is None else buffer.detach().clone())
        for owner in owners
        for name, buffer in owner._buffers.items()
    ]
    try:
        yield
    finally:
        for owner, names in present:  # a buffer a forward registered is taken off again
            for name in set(owner._buffers) - names:
                del owner._buffers[name]
        for owner, name, buffer, value in saved:
            owner._buffers[name] = buffer  # a buffer registered as None that a forward filled is None again
            if buffer is not None and value is not None:  # through .data: an earlier forward's backward saved it
                buffer.data.copy_(value)


@contextlib.contextmanager
def kept_attributes(module: nn.Module) -> Iterator[None]:
    """Put back the tensors ``module`` and its submodules keep in plain attributes (a recurrent state a forward
    replaces, ``self.h = h.detach()``), as they were: a tensor a forward set where there was none is taken off, and
    one it replaced comes back."""
    owners = list(module.modules())
    before = [dict(vars(owner)) for owner in owners]
    try:
        yield
    finally:
        for owner, was in zip(owners, before, strict=True):
            for name, value in list(vars(owner).items()):
                old = was.get(name, _ABSENT)
                if value is old or not (isinstance(value, torch.Tensor) or isinstance(old, torch.Tensor)):
                    continue
                if old is _ABSENT:
                    del vars(owner)[name]
                else:
                    vars(owner)[name] = old


_ABSENT = object()
NO_GRAD = "does not require grad"  # torch's "element 0 of tensors does not require grad and does not have a grad_fn"


def probe_forward(module: nn.Module, args: Any, kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` on copies of the inputs, without autograd; its outputs. The random streams, the
    module's buffers and its tensor attributes are as they were before, whether it returned or raised.

    A forward that differentiates itself (``torch.autograd.grad`` inside, a physics-informed net's) fails without
    autograd (``NO_GRAD``): it runs again with it, on copies that require grad as the inputs do, and its outputs are
    detached."""
    rng = capture_rng()
    try:
        with kept_buffers(module), kept_attributes(module), torch.no_grad():
            return module(*copied(args), **copied(kwargs))
    except RuntimeError as exc:
        if NO_GRAD not in str(exc):  # a failure of the precision's or layout's own: the caller's to weigh
            raise
        restore_rng(rng)
        with kept_buffers(module), kept_attributes(module), torch.enable_grad():
            out = module(*copied(args, grad=True), **copied(kwargs, grad=True))
        return map_tensors(out, torch.Tensor.detach)
    finally:
        restore_rng(rng)


def copied(inputs: Any, *, grad: bool = False) -> Any:
    """``inputs`` (tensors in tuples, lists, dicts, dataclasses) with each tensor cloned; ``grad``: as new leaves that
    require grad where the inputs do."""
    if not grad:
        return map_tensors(inputs, torch.clone)
    return map_tensors(inputs, lambda t: t.detach().clone().requires_grad_(t.requires_grad))
