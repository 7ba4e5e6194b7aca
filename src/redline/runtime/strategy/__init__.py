"""Strategies: how a model is spread over the processes of a run, and how its state is saved and loaded.

plan/strategy.py decides (one device, DDP or FSDP2, with the reason); ``build_strategy`` returns the
object that applies the choice. Every strategy answers the same questions, the ``Strategy`` protocol:
wrap a model and build its optimizer, tell whether a backward synchronises gradients (or accumulate
them locally and average them once), hand back the
user's module, give and take the state, save and load a checkpoint, and write the whole weights. A
new strategy is one more module here that answers them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from redline.checkpoint import Checkpoint
from redline.plan import Choice
from redline.plan.precision import PrecisionName
from redline.plan.strategy import StrategyName
from redline.runtime.optimizer import OptimizerLike
from redline.runtime.strategy.ddp import DDP
from redline.runtime.strategy.single import SingleDevice


class Strategy(Protocol):
    """What the Runtime asks of a strategy; each method is collective where the strategy spans processes."""

    name: StrategyName
    detail: str  # how it applies the choice, for the Plan's reason ("" when there is nothing to add)

    def wrap(
        self, model: nn.Module, optimizer: OptimizerLike, *, device: torch.device, precision: PrecisionName
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap ``model`` (already on ``device``) and build its optimizer on the parameters it will train."""
        ...

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        """Return the context of a backward that does (or, mid-accumulation, does not) reduce gradients."""
        ...

    def expect_sync(self, model: nn.Module, enabled: bool) -> None:
        """Say, before the forward of ``model``'s next backward, whether that backward reduces (DDP decides early)."""
        ...

    def accumulate_locally(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Return the context of forwards and backwards that communicate nothing: gradients stay on this rank."""
        ...

    def average_gradients(self, model: nn.Module) -> None:
        """Average the gradients accumulated locally over the ranks, in one pass (collective)."""
        ...

    def module(self, model: nn.Module) -> nn.Module:
        """Return the user's module inside the wrapped ``model`` (its parameter names as the user wrote them)."""
        ...

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Return ``{"model": ..., "optimizer": ...}`` as this strategy holds them (sharded under FSDP)."""
        ...

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned into ``model`` and ``optimizer``."""
        ...

    def save(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, runtime_state: dict[str, Any],
        extra: dict[str, Any], plan: dict[str, Any], step: int | None,
    ) -> Checkpoint:  # fmt: skip
        """Write a checkpoint directory at ``path`` atomically; every rank returns it once it is committed."""
        ...

    def load(
        self, checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load a checkpoint of either format into ``model`` and ``optimizer``; return its runtime and extra state."""
        ...

    def save_weights(self, path: Path, model: nn.Module) -> None:
        """Write the whole weights as one safetensors file that loads into the plain model (rank 0 writes)."""
        ...


def build_strategy(name: StrategyName, *, find_unused_parameters: bool = False) -> Strategy:
    """Return the strategy object for a resolved strategy name (``find_unused_parameters`` is DDP's)."""
    if name == "ddp":
        return DDP(find_unused_parameters=find_unused_parameters)
    if name == "fsdp":
        # Imported here: torch.distributed.checkpoint and DTensor take about a second to import, which a run
        # that does not shard (and every `redline` command that only plans or refuses) need not pay.
        from redline.runtime.strategy.fsdp import FSDP

        return FSDP()
    return SingleDevice()


def explained(
    choice: Choice[StrategyName], strategy: Strategy, *, find_unused_parameters: bool
) -> Choice[StrategyName]:
    """``choice`` with how ``strategy`` applies it (its ``detail``); ``find_unused_parameters`` asked for where no DDP
    runs (one process, FSDP) does nothing, and the Plan says so."""
    notes = [choice.reason, strategy.detail]
    if find_unused_parameters and choice.value != "ddp":
        notes.append("find_unused_parameters is DDP's: it does nothing here")
    return Choice(choice.value, "; ".join(filter(None, notes)))
