"""Activation checkpointing: a model's repeated blocks keep only their input and recompute the rest in backward.

Each block's ``forward`` is replaced on the instance, so the parameter and state_dict names stay as
they were (a wrapper module would add a prefix to every key): checkpoints and weights load with or
without it. The recomputation is ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, which
re-enters the forward's autocast state and restores the RNG state for dropout
(``preserve_rng_state``), works inside a model compiled afterwards, and under FSDP2 and DDP:
https://pytorch.org/docs/stable/checkpoint.html. The decision is ``plan.checkpointing``'s.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

from redline.errors import ConfigError
from redline.parallel.blocks import find_blocks  # FSDP's blocks too: one rule for both
from redline.plan import Choice
from redline.plan.checkpointing import resolve_activation_checkpointing

_OWN_FORWARD = "_redline_own_forward"  # a forward the user had set on the instance, kept to call and put back


def apply_checkpointing(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> int:
    """Make each of ``blocks`` (``find_blocks``'s) recompute its activations in backward; return how many began to.

    Idempotent: a block that recomputes already is left as it is. Outside training, or with gradients
    off (``no_grad``, ``inference_mode``), a block runs its plain forward. Apply before wrapping the
    model for DDP or FSDP and before compiling it; applied to a compiled model, it compiles again once.
    """
    inside = {id(module) for module in model.modules()}
    started = 0
    for name, block in blocks:
        if id(block) not in inside:
            raise ConfigError(
                f"block {name!r} ({type(block).__name__}) is not a module of {type(model).__name__}\n"
                "hint: pass the blocks find_blocks(model) returned for this model"
            )
        if is_checkpointed(block):
            continue
        own = vars(block).get("forward")
        if own is not None:
            setattr(block, _OWN_FORWARD, own)
        # A partial, unlike a bound method, also survives pickling (torch.save of the whole model);
        # copy.deepcopy of the model gives the copy's block a partial of its own.
        block.forward = functools.partial(_recomputing_forward, block)
        started += 1
    return started


def remove_checkpointing(model: nn.Module) -> int:
    """Give every block of ``model`` that ``apply_checkpointing`` changed its forward back; return how many."""
    removed = 0
    for block in model.modules():
        if not is_checkpointed(block):
            continue
        own = vars(block).pop(_OWN_FORWARD, None)
        del block.forward
        if own is not None:
            block.forward = own
        removed += 1
    return removed


def is_checkpointed(block: nn.Module) -> bool:
    """Whether ``block`` recomputes its activations in backward (``apply_checkpointing`` made it)."""
    forward = vars(block).get("forward")
    return isinstance(forward, functools.partial) and forward.func is _recomputing_forward


def _recomputing_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = vars(self).get(_OWN_FORWARD) or types.MethodType(type(self).forward, self)
    if not (self.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    stats = running_stats(self, training=True)
    if stats and not torch.compiler.is_compiling():  # a compiled graph recomputes without its buffers' updates
        context = functools.partial(_stats_kept, stats)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def running_stats(module: nn.Module, *, training: bool = False) -> list[torch.Tensor]:
    """The running statistics of ``module``'s batch norms (mean, variance, count), which a training forward moves;
    with ``training``, of those in training mode only."""
    return [
        t
        for m in module.modules()
        if isinstance(m, _NormBase) and m.track_running_stats and (m.training or not training)
        for t in (m.running_mean, m.running_var, m.num_batches_tracked)
        if t is not None
    ]


def _stats_kept(
    stats: list[torch.Tensor],
) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """The forward's context (nothing) and the recomputation's: the batch norms' running statistics as the forward
    left them, so that a recomputed training forward does not update them a second time (ResNet's stages are full
    of them)."""
    return contextlib.nullcontext(), _restoring(stats)


@contextlib.contextmanager
def _restoring(stats: list[torch.Tensor]) -> Iterator[None]:
    saved = [t.clone() for t in stats]
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_(stats, saved)


class ActivationCheckpointing:
    """Apply the Plan's activation-checkpointing axis: at setup, and later when "auto" finds memory short."""

    def __init__(self) -> None:
        self.requested = "auto"
        self.found: list[tuple[nn.Module, list[tuple[str, nn.Module]]]] = []  # each set-up model and its blocks

    def setup(self, model: nn.Module, requested: str) -> Choice[bool]:
        """Find ``model``'s blocks, decide, and make them recompute if decided; return the decision."""
        blocks = find_blocks(model)
        chosen = resolve_activation_checkpointing(requested, blocks=len(blocks))
        if chosen.value:
            apply_checkpointing(model, blocks)
        self.requested = requested
        self.found.append((model, blocks))
        return chosen

    def enable(self, reason: str) -> Choice[bool] | None:
        """Turn it on under "auto" because ``reason``; return the new decision, or None when nothing changed.

        Nothing changes when "on" or "off" was requested, or when no set-up model has blocks left to change.
        """
        waiting = sum(not is_checkpointed(block) for _, blocks in self.found for _, block in blocks)
        if self.requested != "auto" or waiting == 0:
            return None
        chosen = resolve_activation_checkpointing(self.requested, blocks=waiting, short_of_memory=True)
        for model, blocks in self.found:
            apply_checkpointing(model, blocks)
        return Choice(chosen.value, f"{chosen.reason}: {reason}")
