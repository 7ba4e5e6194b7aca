"""The few collectives the Trainer needs, each a no-op in a single process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist


def active() -> bool:
    """Whether a process group with more than one rank is running."""
    return torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Return the sum of ``tensor`` over all ranks (the tensor itself in one process)."""
    if active():
        tensor = tensor.clone()
        torch_dist.all_reduce(tensor)
    return tensor


def barrier() -> None:
    """Wait for every rank."""
    if active():
        torch_dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Return every rank's ``obj``, in rank order, on every rank (``[obj]`` in one process)."""
    if not active():
        return [obj]
    gathered: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(gathered, obj)
    return gathered


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that broke (a peer died or hung up), not an error of this rank's own.

    NCCL raises ``DistBackendError``; gloo a plain RuntimeError from its transport, named in the text.
    """
    if isinstance(exc, torch_dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("gloo/transport" in text or "Connection reset by peer" in text)
