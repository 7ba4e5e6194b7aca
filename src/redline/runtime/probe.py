"""A forward that leaves no trace: on copies of the inputs, without autograd, the random streams and buffers put back.

The run's first steps check what "auto" chose by running the model once more on a step's own inputs before that
step's forward (runtime/precision_check.py: the other precision; runtime/layout.py: a channels_last layout). The
step's own forward then runs as if the check had not: dropout draws the same mask, BatchNorm's running statistics
move once, and a forward that changes its inputs in place changes copies. What a forward does besides computing
(a call counter, a hook of the user's) happens at the check too.
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


def probe_forward(module: nn.Module, args: Any, kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` on copies of the inputs, without autograd; its outputs. The random streams and the
    module's buffers are as they were before, whether it returned or raised."""
    rng = capture_rng()
    try:
        with kept_buffers(module), torch.no_grad():
            return module(*copied(args), **copied(kwargs))
    finally:
        restore_rng(rng)


def copied(inputs: Any) -> Any:
    """``inputs`` (tensors in tuples, lists, dicts, dataclasses) with each tensor cloned."""
    return map_tensors(inputs, torch.clone)
