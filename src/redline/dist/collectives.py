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


class StopVote:
    """Every rank learns, one step late and without waiting, whether any rank was asked to stop.

    Each step every rank posts its vote (did it receive SIGTERM/SIGINT?) as an asynchronous sum on a
    gloo group of its own, on the CPU, so the device is never synchronised and the training
    collectives are not delayed; the next step reads the result, by then long complete. All ranks
    read the same sum at the same step, so they stop together within two steps of the signal, whatever
    ``log_every`` is. In one process the vote is the signal itself.
    """

    def __init__(self) -> None:
        self.group = torch_dist.new_group(backend="gloo") if active() else None  # collective: every rank
        self._pending: tuple[Any, torch.Tensor] | None = None

    def vote(self, stop: bool) -> bool:
        """Post this step's vote; return whether any rank voted to stop the step before (or now, alone)."""
        if self.group is None:
            return stop
        agreed = self._read()
        flag = torch.tensor([1.0 if stop else 0.0])
        self._pending = (torch_dist.all_reduce(flag, group=self.group, async_op=True), flag)
        return agreed

    def close(self) -> None:
        """Wait for the last vote, which every rank posted: no collective is left in flight."""
        self._read()

    def _read(self) -> bool:
        if self._pending is None:
            return False
        work, flag = self._pending
        work.wait()
        self._pending = None
        return bool(flag.item() > 0)
