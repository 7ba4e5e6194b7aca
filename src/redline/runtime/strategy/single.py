"""One device in one process: the model as given, and the whole checkpoint format."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from redline.checkpoint import Checkpoint, CheckpointError, whole
from redline.checkpoint.shapes import differences, shapes_of
from redline.plan.precision import PrecisionName
from redline.plan.strategy import StrategyName
from redline.runtime.optimizer import OptimizerLike, build_optimizer

_NOTHING = contextlib.nullcontext()
STATE = "rt.load_state_dict(state)"  # what a refused state is named by


class SingleDevice:
    """Train the model as it is on one device; write whole checkpoints."""

    name: StrategyName = "single"
    detail = ""

    def wrap(
        self, model: nn.Module, optimizer: OptimizerLike, *, device: torch.device, precision: PrecisionName
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        return model, build_optimizer(optimizer, model)

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        return _NOTHING  # one process: nothing to synchronise

    def expect_sync(self, model: nn.Module, enabled: bool) -> None:
        return None

    def accumulate_locally(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return _NOTHING

    def average_gradients(self, model: nn.Module) -> None:
        return None

    def module(self, model: nn.Module) -> nn.Module:
        return model

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # A model the user compiled: its own names, not the wrapper's `_orig_mod.` ones, which load into nothing else.
        return {"model": whole.plain_module(self.module(model)).state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        wrapper = self.module(model)  # a state taken with the wrapper's names (before redline dropped them) loads there
        into = wrapper if set(state["model"]) == set(wrapper.state_dict()) else whole.plain_module(wrapper)
        # Checked before anything loads: torch's own loads would change the weights, then raise.
        found = differences(shapes_of(state["model"]), shapes_of(into.state_dict()))
        if found:
            raise CheckpointError(
                f"{STATE}: the state's model differs from this run's model: {'; '.join(found)}\nhint: load a "
                "state that rt.state_dict() returned for this model (the same modules, the same shapes)"
            )
        whole.check_same_optimizer(STATE, state["optimizer"], optimizer, holder="the state")
        into.load_state_dict(state["model"])
        optimizer.load_state_dict(whole.run_as_this_run(state["optimizer"], optimizer))

    def save(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, runtime_state: dict[str, Any],
        extra: dict[str, Any], plan: dict[str, Any], step: int | None,
    ) -> Checkpoint:  # fmt: skip
        return whole.save_whole(
            path, module=self.module(model), optimizer_state=optimizer.state_dict(), runtime_state=runtime_state,
            extra=extra, plan=plan, step=step,
        )  # fmt: skip

    def load(
        self, checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        if checkpoint.sharded:  # an FSDP run's: DCP gathers the pieces into the whole model
            from redline.checkpoint.sharded import load_sharded  # slow to import (DCP); only a sharded one needs it

            return load_sharded(checkpoint, model, optimizer)
        states = whole.read_states(checkpoint)  # first: a state that cannot be read leaves the run as it was
        whole.load_model_and_optimizer(checkpoint, self.module(model), optimizer)
        return states

    def save_weights(self, path: Path, model: nn.Module) -> None:
        whole.save_weights_file(path, self.module(model))
