"""The few collectives the Runtime, the checkpoints and the Trainer need, each a no-op in a single process."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as torch_dist

from redline.errors import RedlineError, TrainingError

T = TypeVar("T")


class RankZeroError(RedlineError):
    """Work that rank 0 did for every rank (a checkpoint's commit) failed there."""


def active() -> bool:
    """Whether a process group with more than one rank is running."""
    return torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Return the sum of ``tensor`` over all ranks (the tensor itself in one process)."""
    if active():
        tensor = tensor.clone()
        torch_dist.all_reduce(tensor)
    return tensor


def all_reduce_max(value: int, device: torch.device) -> int:
    """Return the largest ``value`` over all ranks (``value`` itself in one process); waits for the device once."""
    if not active():
        return value
    flag = torch.tensor([value], dtype=torch.int32, device=device)  # on the device: NCCL reduces device tensors
    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX)
    return int(flag.item())


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: large enough to amortise a call, small enough to copy


def average_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Average ``tensors`` in place over all ranks: flattened into buckets, one all-reduce each (no-op alone).

    Every rank passes tensors of the same shapes and dtypes, in the same order.
    """
    if not active():
        return
    world = torch_dist.get_world_size()

    def average(flat: torch.Tensor) -> None:
        torch_dist.all_reduce(flat)
        flat /= world

    _each_bucket(tensors, average)


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Give every rank ``src``'s values of ``tensors``, in place, a bucket a call (no-op alone)."""
    if active():
        _each_bucket(tensors, lambda flat: torch_dist.broadcast(flat, src=src))


def share_buffers(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers of ``model`` (BatchNorm's running statistics), in place (no-op alone).

    DDP broadcasts them at each training forward; FSDP never does, so each rank's drift apart with its own
    batches. Collective: every rank calls it, before it evaluates or saves a sharded checkpoint.
    """
    broadcast_tensors([buffer.data for buffer in model.buffers()])


def _each_bucket(tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], Any]) -> None:
    """Run ``collective`` on each bucket of ``tensors`` flattened into one tensor, then copy the result back."""
    for bucket in _buckets(tensors):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        collective(flat)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group ``tensors`` of one dtype and device, in order, into buckets of about BUCKET_BYTES."""
    out: list[list[torch.Tensor]] = []
    size, kind = 0, None
    for t in tensors:
        if not out or (t.dtype, t.device) != kind or size + t.numel() * t.element_size() > BUCKET_BYTES:
            out.append([])
            size, kind = 0, (t.dtype, t.device)
        out[-1].append(t)
        size += t.numel() * t.element_size()
    return out


def rank_and_world() -> tuple[int, int]:
    """Return this process's rank and the number of ranks ((0, 1) without a process group)."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank(), torch_dist.get_world_size()
    return 0, 1


def run_on_rank0(action: Callable[[], T], what: str) -> T:
    """Run ``action`` on rank 0 and hand its result to every rank; if it fails, every rank raises.

    No rank is left waiting for a rank 0 that failed: rank 0 re-raises its own error, the others a
    RankZeroError carrying its whole message (hint included). The result must be picklable.
    """
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return action()
    result, failure = None, None
    if torch_dist.get_rank() == 0:
        try:
            result = action()
        except Exception as exc:  # handed to every rank, then raised there
            failure = exc
    box: list[Any] = [(result, f"{type(failure).__name__}: {failure}" if failure is not None else None)]
    torch_dist.broadcast_object_list(box, src=0)  # the others' boxes are replaced by rank 0's
    result, error = box[0]
    if failure is not None:
        raise failure
    if error is not None:
        raise RankZeroError(f"{what} failed on rank 0: {error}")
    return result


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


@contextlib.contextmanager
def peers_said(where: str, hint: str) -> Iterator[None]:
    """Inside, a collective that breaks (``is_collective_failure``) raises a TrainingError: "{where}: a collective
    with the other ranks failed", and ``hint``, in place of the transport's own words ("Connection closed by peer")."""
    try:
        yield
    except Exception as exc:
        if not is_collective_failure(exc):
            raise
        raise TrainingError(
            f"{where}: a collective with the other ranks failed: {failed_collective(exc)}\nhint: {hint}"
        ) from exc


def failed_collective(exc: BaseException) -> str:
    """What a broken collective says, in its first sentence: gloo's "[.../pair.cc:553] Connection closed by peer
    [127.0.0.1]:9402. This is typically caused by ... GLHF!" is "Connection closed by peer [127.0.0.1]:9402"."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return re.sub(r"^\[[^\]]*\.cc:\d+\]\s*", "", first).split(". ", 1)[0]


VOTE_PERIOD_S = 0.2  # how often, in training time, the ranks vote on stopping
MAX_VOTE_INTERVAL = 1000


def vote_interval(step_seconds: float) -> int:
    """Return every how many steps to vote so a vote comes about every VOTE_PERIOD_S of training."""
    if not step_seconds > 0:
        return 1
    return max(1, min(MAX_VOTE_INTERVAL, int(VOTE_PERIOD_S / step_seconds)))


class Agreed(NamedTuple):
    """What the ranks agreed at a vote: whether to stop, and whether to write a checkpoint."""

    stop: bool
    checkpoint: bool


class StopVote:
    """Every rank learns, a vote late and without waiting, whether any rank was asked to stop (or to checkpoint).

    At a vote every rank posts whether it received SIGTERM/SIGINT, and whether its clock says a
    checkpoint is due, as an asynchronous sum on a gloo group of its own, on the CPU, so the device is
    never synchronised and the training collectives are not delayed; the next vote reads the result,
    by then long complete. All ranks read the same sums at the same step, so they stop (or checkpoint)
    together. A vote held the loop about 0.2 ms on 2 CPU processes (benchmarks/results/stop-vote-cpu.md),
    so the ranks vote every step until they know the step time, then every ``vote_interval`` steps
    (about every 0.2 s): a stop comes within two votes of the signal, whatever ``log_every`` is. In one
    process the vote is the rank's own, at once.
    """

    def __init__(self) -> None:
        self.group = torch_dist.new_group(backend="gloo") if active() else None  # collective: every rank
        self.every = 1
        self._pending: tuple[Any, torch.Tensor] | None = None

    def vote(self, stop: bool, step: int, *, checkpoint: bool = False) -> Agreed:
        """At a voting step post this rank's votes; return what any rank voted for at the vote before."""
        if self.group is None:
            return Agreed(stop, checkpoint)
        if step % self.every:
            return Agreed(False, False)
        agreed = self._read()
        flags = torch.tensor([float(stop), float(checkpoint)])
        self._pending = (torch_dist.all_reduce(flags, group=self.group, async_op=True), flags)
        return agreed

    def now(self, stop: bool) -> bool:
        """Whether any rank was asked to stop, agreed at once (a blocking sum on the vote's group): after an
        evaluation, which every rank runs at the same step, a signal that came during it stops the run there, not a
        vote after the next step. One process answers ``stop``."""
        if self.group is None:
            return stop
        flags = torch.tensor([float(stop)])
        torch_dist.all_reduce(flags, group=self.group)  # after the pending vote's sum, in order on every rank
        return bool(flags[0].item() > 0)

    def pace(self, step_seconds: float) -> None:
        """Set the voting interval from the step time, which must be the same number on every rank."""
        self.every = vote_interval(step_seconds)

    def close(self) -> None:
        """Wait for the last vote, which every rank posted: no collective is left in flight."""
        self._read()

    def _read(self) -> Agreed:
        if self._pending is None:
            return Agreed(False, False)
        work, flags = self._pending
        work.wait()
        self._pending = None
        return Agreed(bool(flags[0].item() > 0), bool(flags[1].item() > 0))
