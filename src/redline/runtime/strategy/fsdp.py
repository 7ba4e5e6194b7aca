"""Fully sharded data parallel (FSDP2): parameters, gradients and optimizer state split over the ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from redline.checkpoint import Checkpoint, whole
from redline.checkpoint.sharded import load_sharded, save_sharded
from redline.errors import ConfigError
from redline.parallel.collectives import rank_and_world, run_on_rank0, share_buffers
from redline.parallel.fsdp import full_state, full_weights, load_full_state, shard
from redline.plan.precision import PrecisionName
from redline.plan.strategy import StrategyName
from redline.runtime.optimizer import OptimizerLike, build_optimizer, check_stateless, rebuild_optimizer

_NO_LOCAL = (
    "FSDP cannot accumulate gradients without communicating: every forward gathers the sharded weights\n"
    "hint: with strategy 'fsdp' pass a fixed --micro-batch N (reduced on the last micro-batch), not auto"
)


class FSDP:
    """Shard each repeated block and the root with FSDP2; every rank writes its shards of a checkpoint."""

    name: StrategyName = "fsdp"
    detail = ""

    def wrap(
        self, model: nn.Module, optimizer: OptimizerLike, *, device: torch.device, precision: PrecisionName
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Shard ``model`` in place and build or rebuild its optimizer on the sharded parameters.

        ``fully_shard`` replaces the parameters with DTensors. A factory is called on them, so the
        optimizer is the factory's own (its hooks, its constructor's arguments). An optimizer built before
        is rebuilt on them: its class, groups, hyperparameters and hooks carry over, each parameter matched
        by its name. It must hold no state yet (pass it before its first step, or as a factory).
        """
        _, world = rank_and_world()
        self.detail = (
            "blocks resharded after forward, gathered again in backward" if world > 1 else
            "one rank: blocks stay gathered from forward to backward (resharding would free nothing)"
        )  # fmt: skip
        if not isinstance(optimizer, torch.optim.Optimizer):  # called once, as on one device
            shard(model, precision=precision, reshard=world > 1)
            return model, build_optimizer(optimizer, model)
        check_stateless(optimizer, " on the sharded parameters")  # before the model changes, not after
        built = build_optimizer(optimizer, model)
        names = {id(p): name for name, p in model.named_parameters()}
        shard(model, precision=precision, reshard=world > 1)
        sharded = dict(model.named_parameters())
        for group in built.param_groups:  # the old optimizer is discarded: point its groups at the new parameters
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return model, rebuild_optimizer(built)

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        return _gradient_sync(model, enabled)

    def expect_sync(self, model: nn.Module, enabled: bool) -> None:
        return None  # FSDP2 decides in the backward (gradient_sync)

    def accumulate_locally(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        raise ConfigError(_NO_LOCAL)

    def average_gradients(self, model: nn.Module) -> None:
        raise ConfigError(_NO_LOCAL)

    def module(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard changes the model in place: its names are the user's

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        fresh = not optimizer.state
        model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards, as DTensors
        if fresh:  # get_state_dict stepped it once with lr=0 to give it state: the run must not count that step
            optimizer.state.clear()
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def save(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, runtime_state: dict[str, Any],
        extra: dict[str, Any], plan: dict[str, Any], step: int | None,
    ) -> Checkpoint:  # fmt: skip
        share_buffers(model)  # each rank's own running statistics: DCP would keep any one rank's
        return save_sharded(path, model, optimizer, runtime_state=runtime_state, extra=extra, plan=plan, step=step)

    def load(
        self, checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        if checkpoint.sharded:
            return load_sharded(checkpoint, model, optimizer)
        # A whole checkpoint (one device's, DDP's): rank 0 reads it once and broadcasts the pieces.
        states: dict[str, dict[str, Any]] = {"model": {}, "optimizer": {}}

        def read() -> bool:
            whole.check_model(checkpoint, model)  # the sharded model's names, and its whole shapes
            weights, optimizer_state = whole.read_weights(checkpoint), whole.read_optimizer(checkpoint)
            states["model"], states["optimizer"] = full_state(model, optimizer, weights, optimizer_state)
            return not optimizer_state["state"]

        fresh = run_on_rank0(read, "reading the whole checkpoint")  # saved before the optimizer's first step
        load_full_state(model, optimizer, states["model"], states["optimizer"])
        if fresh:  # loading stepped it once with lr=0 to give it state: Adam would count that step
            optimizer.state.clear()
        return whole.read_states(checkpoint)

    def save_weights(self, path: Path, model: nn.Module) -> None:
        weights, aliases = full_weights(model)  # collective: every rank sends its shards to rank 0
        run_on_rank0(lambda: whole.save_tensors_file(path, weights, aliases), "writing the weights")


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    setter = getattr(model, "set_requires_gradient_sync", None)  # an FSDP2 module
    if enabled or setter is None:
        yield
        return
    setter(False)  # mid-accumulation: gradients stay unreduced until the last micro-batch
    try:
        yield
    finally:
        setter(True)
