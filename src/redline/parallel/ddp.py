"""DDP: replicate a model on every rank and all-reduce its gradients during backward."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def wrap_ddp(
    model: nn.Module, device: torch.device, *, find_unused_parameters: bool = False
) -> DistributedDataParallel:
    """Replicate ``model`` with DDP: rank 0's weights are broadcast, gradients all-reduced in backward.

    ``gradient_as_bucket_view``: each parameter's ``.grad`` is a view into DDP's communication
    bucket, so the gradients are not copied into the buckets before the all-reduce and back out
    after it (two passes over 4 bytes a parameter every step), and the memory of one copy of the
    gradients is saved (https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html).
    The numbers are the same; ``zero_grad(set_to_none=True)`` keeps working. ``find_unused_parameters``
    has DDP walk the autograd graph after each forward to mark the parameters it did not reach as ready,
    so a model that uses other parameters in other steps can be reduced at all.
    """
    device_ids = [device.index] if device.type == "cuda" and device.index is not None else None
    return DistributedDataParallel(
        model, device_ids=device_ids, gradient_as_bucket_view=True, find_unused_parameters=find_unused_parameters
    )
