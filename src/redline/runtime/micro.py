"""Micro-batches: a batch run as several, its gradients accumulated, halved when the device runs out of memory.

``Runtime.train_step(step_fn, batch)`` runs here. The batch is split along its first axis (every
tensor whose first axis is the batch's; any other leaf is given to each micro-batch as it is), each
micro-batch's loss is weighted by its share of the batch and back-propagated through the precision,
so the optimizer step sees the gradient of the whole batch. With "auto" the batch runs whole until
the device runs out of memory; then the failed step's tensors are let go, the memory freed, the
micro-batch halved and the batch done again: the effective batch is unchanged and no step is lost.
Under DDP a fixed size keeps DDP's own overlap: the micro-batches before the last run without
gradient sync and the last one's backward all-reduces as it goes. With "auto" the micro-batches
communicate nothing (a rank out of memory mid-backward would leave the others waiting in DDP's
all-reduce), the ranks agree afterwards whether any ran out of memory (one all-reduce of a flag),
and the gradients are averaged over the ranks once, after the backward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from redline.errors import OutOfMemory, RedlineError
from redline.parallel.collectives import all_reduce_max, rank_and_world
from redline.plan import Choice
from redline.plan.micro_batch import MicroBatch, after_oom, resolve_micro_batch, whole_again
from redline.runtime.contract import one_sample_refusal
from redline.runtime.loss import check_loss
from redline.runtime.oom import free_memory, is_oom
from redline.runtime.precision import Precision
from redline.runtime.samples import batch_length, take
from redline.runtime.snapshot import write_memory_snapshot
from redline.runtime.strategy import Strategy

log = logging.getLogger("redline")

Where = Literal["forward", "backward"]
_CODE: dict[Where | None, int] = {None: 0, "forward": 1, "backward": 2}  # the ranks agree on the largest
_WHERE: dict[int, Where] = {1: "forward", 2: "backward"}
SOURCE = "step_fn(batch) returned"
FIT_HINT = (
    "make a sample need less memory: precision='bf16-mixed' (--precision bf16-mixed) halves the activations; "
    "activation checkpointing recomputes them in backward instead of keeping them; FSDP shards the weights, "
    "gradients and optimizer state over N GPUs (`redline launch --nproc N` with --strategy fsdp); or use a GPU with "
    "more memory. `redline memory --task SPEC` estimates what the run needs"
)


@dataclass(frozen=True)
class OomEvent:
    """A recovery from out-of-memory: the step it struck in, the micro-batch that failed, the next one, and where."""

    step: int
    from_size: int
    to_size: int
    where: Where  # on this rank, or on the rank that failed (backward if one rank failed there)
    snapshot: Path | None = None  # this rank's memory snapshot (CUDA, with a snapshot directory)
    checkpointing: bool = False  # activation checkpointing was turned on, and the batch redone from to_size


@dataclass(frozen=True, kw_only=True)
class BatchRun:
    """How the Runtime runs this call's batch: the objects that apply the Plan and where the batch stands."""

    precision: Precision
    strategy: Strategy
    models: Sequence[nn.Module]  # the set-up models: their gradients are synchronised, or dropped to redo a batch
    device: torch.device
    accum: int  # grad_accum: every loss is divided by it
    sync: bool  # the batch ends an accumulation cycle: its gradients are reduced over the ranks
    step: int  # the optimizer step the batch belongs to, counted from 1
    # no set-up optimizer holds gradients (the batch begins a cycle): an out-of-memory drops the batch's own and
    # redoes it; a parameter no optimizer steps keeps its gradients forever, and does not count
    fresh: bool
    snapshot_dir: Path | None
    # turns activation checkpointing on (reason in, whether it changed anything out): left to "auto", it
    # is the last way to fit before giving up at one sample
    recompute: Callable[[str], bool] | None = None


class MicroBatcher:
    """Run each batch whole, as micro-batches of a fixed size, or ("auto") whole until out-of-memory, then halved."""

    def __init__(self, requested: MicroBatch) -> None:
        self.requested = requested
        self.size: int | None = requested if isinstance(requested, int) else None  # None: the whole batch
        self.choice = resolve_micro_batch(requested)
        self.events: list[OomEvent] = []
        self.last_snapshot: Path | None = None
        self._strategy: str | None = None
        self._failed: list[tuple[int, int]] = []  # (size, step) of each out-of-memory "auto" recovered from

    def plan(self, strategy: str) -> Choice[int | str | None]:
        """Return the Plan's axis for this strategy; "auto" under FSDP is a ConfigError."""
        self._strategy = strategy
        self.choice = resolve_micro_batch(self.requested, strategy=strategy)
        return self.choice

    def resume(self, size: int, reason: str) -> Choice[int | str | None]:
        """Start from the size a resumed run's "auto" had halved to, keeping its reason."""
        self.size, self.choice = size, Choice(size, reason)
        return self.choice

    def run(self, step_fn: Callable[[Any], torch.Tensor], batch: Any, how: BatchRun) -> torch.Tensor:
        """Run ``batch`` through ``step_fn`` and back-propagate it; return its mean loss, detached."""
        if self.requested is None:
            return self._whole(step_fn, batch, how)
        total = batch_length(batch)
        # "auto" under DDP: communicate nothing per micro-batch; agree, then average once. A fixed size fails
        # outright on out-of-memory, so it keeps DDP's all-reduce overlapped with the last backward.
        local = how.strategy.name == "ddp" and self.requested == "auto"
        fresh = how.fresh
        size, start, loss = min(self.size or total, total), 0, None
        while True:
            start, where, part = self._pass(step_fn, batch, (start, total, size), how, local=local)
            if part is not None:
                loss = part if loss is None else loss + part
            code = all_reduce_max(_CODE[where], how.device) if local else _CODE[where]
            if not code:
                break
            # Out of the except blocks: the failed step's frames and tensors are gone, so freeing gives them back.
            free_memory(how.device)
            if size == 1 and self._recompute(_WHERE[code], fresh, total, how):
                size = total  # with activations recomputed, the whole batch may fit again: halve from there
            else:
                size = self._halve(size, _WHERE[code], mine=where is not None, fresh=fresh, how=how)
            if fresh:  # nothing was accumulated before this batch: drop its partial gradients and do it again
                for model in how.models:
                    for p in model.parameters():
                        p.grad = None
                start, loss = 0, None
            # else a forward failed: the finished micro-batches' gradients stand, and the rest follows
        if local and how.sync:
            for model in how.models:
                how.strategy.average_gradients(model)
        assert loss is not None
        return loss

    def _whole(self, step_fn: Callable[[Any], torch.Tensor], batch: Any, how: BatchRun) -> torch.Tensor:
        """Run the batch as one; an out-of-memory error propagates, after its snapshot (CUDA)."""
        try:
            with gradient_sync(how, how.sync):
                with how.precision.autocast():
                    loss = check_loss(step_fn(batch), training=True, source=SOURCE)
                how.precision.backward(loss / how.accum if how.accum > 1 else loss)
        except Exception as exc:
            if not isinstance(exc, RedlineError) and is_oom(exc):
                self._snapshot(how, None)
            raise
        return loss.detach()

    def _pass(
        self,
        step_fn: Callable[[Any], torch.Tensor],
        batch: Any,
        span: tuple[int, int, int],
        how: BatchRun,
        *,
        local: bool,
    ) -> tuple[int, Where | None, torch.Tensor | None]:
        """Run micro-batches of at most ``size`` from sample ``start`` to ``total`` (``span``), as even as they split;
        return where it stopped, where it ran out of memory (None if it did not), and the finished micro-batches'
        weighted losses."""
        start, total, size = span
        loss = None
        with contextlib.ExitStack() as stack:
            if local:
                for model in how.models:
                    stack.enter_context(how.strategy.accumulate_locally(model))
            while start < total:
                left = total - start  # in as few micro-batches of at most size as it takes, evened out: 8 at 7 is
                end = start + -(-left // -(-left // size))  # 4 and 4, not 7 and 1 (which BatchNorm cannot train)
                with contextlib.nullcontext() if local else gradient_sync(how, how.sync and end == total):
                    part, where = self._one(step_fn, take(batch, start, end, total), (end - start) / total, size, how)
                if where is not None:
                    return start, where, loss
                assert part is not None
                loss = part if loss is None else loss + part
                start = end
        return start, None, loss

    def _one(
        self, step_fn: Callable[[Any], torch.Tensor], micro: Any, share: float, size: int, how: BatchRun
    ) -> tuple[torch.Tensor | None, Where | None]:
        """Run one micro-batch forward and backward; return its weighted loss (detached), or where memory ran out.

        The snapshot is taken while the failed step's tensors still hold their memory; the rest of the
        handling waits until the exception and its frames are gone.
        """
        try:
            with how.precision.autocast():
                loss = check_loss(step_fn(micro), training=True, source=SOURCE)
        except Exception as exc:
            refusal = one_sample_refusal(exc) if size == 1 and self._failed else None  # halved to 1 by "auto"
            if refusal is not None:
                raise self._no_smaller(how, refusal) from exc
            if isinstance(exc, RedlineError) or not is_oom(exc):
                raise
            self._snapshot(how, size)
            return None, "forward"
        weighted = loss * share if share != 1 else loss
        try:
            how.precision.backward(weighted / how.accum if how.accum > 1 else weighted)
        except Exception as exc:
            if isinstance(exc, RedlineError) or not is_oom(exc):
                raise
            self._snapshot(how, size)
            return None, "backward"
        return weighted.detach(), None

    def _halve(self, size: int, where: Where, *, mine: bool, fresh: bool, how: BatchRun) -> int:
        """Record the recovery and return the next micro-batch size, or raise when there is none to go to."""
        rank, world = rank_and_world()
        on = (f" on rank {rank}" if mine else " on another rank") if world > 1 else ""
        at = f"step {how.step}, in {where}{on}"
        snapshot = f"; memory snapshot: {self.last_snapshot}" if mine and self.last_snapshot else ""
        if self.requested != "auto":
            raise OutOfMemory(
                f"out of memory with micro-batches of {size} samples ({at}){snapshot}\n"
                "hint: pass --micro-batch auto (micro_batch='auto') to halve it on out-of-memory and redo the batch, "
                "or a smaller --micro-batch"
            )
        if size == 1:
            raise OutOfMemory(
                f"out of memory with micro-batches of 1 sample ({at}): even one sample does not fit on "
                f"{how.device}{snapshot}\nhint: {FIT_HINT}"
            )
        if not fresh and where == "backward":
            raise OutOfMemory(
                f"out of memory with micro-batches of {size} samples ({at}), after earlier batches of this "
                f"accumulation cycle (grad_accum={how.accum}) had added their gradients: a backward that failed "
                f"half-way cannot be taken back{snapshot}\nhint: start with micro-batches that fit: "
                f"--micro-batch {size // 2} (micro_batch={size // 2})"
            )
        new = size // 2
        self.events.append(OomEvent(how.step, size, new, where, self.last_snapshot if mine else None))
        self._failed.append((size, how.step))
        self.size = new
        self.choice = after_oom(self._failed, new, strategy=self._strategy)
        redo = "doing the batch again" if fresh else "going on with the rest of the batch"
        log.warning(
            "out of memory with micro-batches of %d samples (%s): freed the memory, halved them to %d and %s by "
            "gradient accumulation; the effective batch is unchanged",
            size, at, new, redo,
        )  # fmt: skip
        return new

    def _no_smaller(self, how: BatchRun, refusal: BaseException) -> OutOfMemory:
        """The error when "auto" halved to 1 sample and the model cannot train on one (batch norm over (N, C))."""
        said = str(refusal).splitlines()[0]
        return OutOfMemory(
            f"out of memory with micro-batches of 2 samples (step {how.step}), and the model cannot train on 1: "
            f"{said}\nhint: {FIT_HINT}"
        )

    def _recompute(self, where: Where, fresh: bool, total: int, how: BatchRun) -> bool:
        """At one sample, with "auto" micro-batches: turn activation checkpointing on if it was left to "auto"."""
        if self.requested != "auto" or how.recompute is None or (where == "backward" and not fresh):
            return False
        reason = f"auto: turned on at step {how.step}, when even micro-batches of 1 sample ran out of memory"
        if not how.recompute(reason):
            return False
        self.events.append(OomEvent(how.step, 1, total, where, self.last_snapshot, checkpointing=True))
        self.size, self.choice = None, whole_again(self._failed, how.step, strategy=self._strategy)
        self._failed = []  # a later out-of-memory halves from the whole batch: its own history
        log.warning(
            "out of memory with micro-batches of 1 sample (step %d, in %s): turned activation checkpointing on "
            "(the repeated blocks recompute their activations in backward) and redoing the batch whole",
            how.step, where,
        )  # fmt: skip
        return True

    def _snapshot(self, how: BatchRun, size: int | None) -> None:
        rank, world = rank_and_world()
        name = (
            f"memory-snapshot-step{how.step}"
            + (f"-micro{size}" if size else "")
            + (f"-rank{rank}" if world > 1 else "")
        )
        self.last_snapshot = write_memory_snapshot(how.device, how.snapshot_dir, name)


@contextlib.contextmanager
def gradient_sync(how: BatchRun, enabled: bool) -> Iterator[None]:
    """Enter the strategy's gradient-sync context of every set-up model: reduce in this backward, or not."""
    with contextlib.ExitStack() as stack:
        for model in how.models:
            stack.enter_context(how.strategy.gradient_sync(model, enabled))
        yield
