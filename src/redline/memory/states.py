"""The model states a run holds besides what one traced step does: across ranks (DDP's gradient buckets, FSDP's
shards and the parameters it gathers) and across the micro-batches of an accumulating step (the gradients held
through them). ``estimate_memory`` traces one plain step on one process and adjusts it here."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from redline.parallel.blocks import find_blocks
from redline.runtime.precision import AUTOCAST_DTYPES


@dataclass(frozen=True)
class States:
    """What a traced step's peak holds of the model's states, and the peak itself, in bytes."""

    params: int
    gradients: int
    optimizer_state: int
    activations: int
    peak: int


def as_run(
    traced: States,
    model: nn.Module | None,
    strategy: str,
    world_size: int,
    precision: str,
    grad_accum: int,
    casts: int = 0,
) -> States:
    """Adjust a one-process trace of one plain step for what a run holds besides: the gradients for the whole step
    (DDP's buckets; every micro-batch of an accumulating step), or the model states sharded (FSDP), its gradients
    whole while micro-batches accumulate them unsynced; ``model`` is the Task's model for its structure
    (``meta_model``). ``casts`` are the bytes of autocast's copies of the parameters alive at the traced peak,
    among its activations: FSDP under mixed precision gathers the parameters in the compute dtype already
    (parallel/fsdp.py's MixedPrecisionPolicy), so autocast copies none of them."""
    if model is None:
        return traced
    fsdp = strategy == "fsdp" and world_size > 1
    if (strategy == "ddp" or grad_accum > 1) and not fsdp:  # DDP: gradient_as_bucket_view
        missing = max(trainable_bytes(model) - traced.gradients, 0)
        return dataclasses.replace(traced, gradients=traced.gradients + missing, peak=traced.peak + missing)
    if not fsdp:
        return traced
    states = traced.params + traced.gradients + traced.optimizer_state
    grads = trainable_bytes(model) if grad_accum > 1 else math.ceil(traced.gradients / world_size)
    sharded = [math.ceil(traced.params / world_size), grads, math.ceil(traced.optimizer_state / world_size)]
    gathered = gathered_bytes(model, precision)
    uncast = casts if precision in AUTOCAST_DTYPES else 0
    return States(
        params=sharded[0] + gathered,
        gradients=sharded[1],
        optimizer_state=sharded[2],
        activations=traced.activations - uncast,
        peak=traced.peak - states + sum(sharded) + gathered - uncast,
    )


def trainable_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that get a gradient: DDP buckets only those."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def gathered_bytes(model: nn.Module, precision: str) -> int:
    """The parameters FSDP holds whole on each rank at the step's peak (parallel/fsdp.py shards each block,
    then the root): the root's own (embeddings, head, final norm: gathered from the forward to the end of
    the backward) and two blocks (one computing, the next prefetched)."""
    low = 2 if precision in AUTOCAST_DTYPES else None  # gathered in the compute dtype under mixed precision

    def size(params: Iterable[nn.Parameter]) -> int:
        return sum(p.numel() * (low or p.element_size()) for p in params)

    blocks = [block for _, block in find_blocks(model, layers=True)]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root = size(p for p in model.parameters() if id(p) not in in_blocks)
    return root + 2 * max((size(block.parameters()) for block in blocks), default=0)
