"""Data parallel (DDP): every rank holds the whole model; gradients are all-reduced during backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from redline.checkpoint import Checkpoint, whole
from redline.errors import ConfigError, few
from redline.parallel.collectives import all_reduce_sum, average_tensors, broadcast_tensors, run_on_rank0
from redline.parallel.ddp import wrap_ddp
from redline.plan.precision import PrecisionName
from redline.plan.strategy import StrategyName
from redline.runtime.optimizer import OptimizerLike, build_optimizer
from redline.runtime.strategy.single import SingleDevice


class DDP(SingleDevice):
    """Replicate the model on every rank; rank 0 writes the whole checkpoint, which every rank reads back."""

    name: StrategyName = "ddp"
    detail = "gradients are views into DDP's buckets (no copy in or out)"

    def __init__(self, *, find_unused_parameters: bool = False) -> None:
        self._checked: set[int] = set()  # the models whose first reduction was checked for unused parameters
        self._expected: dict[int, bool] = {}  # whether each model's next backward reduces, as expect_sync set it
        self.find_unused = find_unused_parameters
        if find_unused_parameters:
            self.detail = (
                f"{DDP.detail}; find_unused_parameters: each step walks the autograd graph for the parameters "
                "it leaves without a gradient (requested)"
            )

    def wrap(
        self, model: nn.Module, optimizer: OptimizerLike, *, device: torch.device, precision: PrecisionName
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        if isinstance(model, DistributedDataParallel):  # the set-up model, set up again with a new optimizer: a
            return model, build_optimizer(optimizer, model)  # second wrapper would reduce the same gradients twice
        wrapped = wrap_ddp(model, device, find_unused_parameters=self.find_unused)
        return wrapped, build_optimizer(optimizer, model)

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        if not isinstance(model, DistributedDataParallel):
            return super().gradient_sync(model, enabled)
        if enabled:
            return self._first_reduction_checked(model)
        return model.no_sync()  # mid-accumulation: gradients stay local until the last micro-batch

    def expect_sync(self, model: nn.Module, enabled: bool) -> None:
        """Set whether ``model``'s next forward readies DDP's reducer to all-reduce in the backward that follows.

        DDP decides in the forward, not in the backward: a forward run outside ``no_sync()`` has its backward
        all-reduce whatever context that backward runs in. The user's own loop runs the forward before
        ``rt.backward``, so the decision is set ahead, after each step, for the batches of the cycle to come.
        """
        if isinstance(model, DistributedDataParallel):
            model.require_backward_grad_sync = self._expected[id(model)] = enabled

    @contextlib.contextmanager
    def _first_reduction_checked(self, model: DistributedDataParallel) -> Iterator[None]:
        """Reduce in this backward; after the first, refuse a model with parameters the loss did not use.

        A forward run while mid-accumulation was expected (``expect_sync``) readied no reduction: its
        gradients are averaged after the backward instead, in one pass. DDP's reducer waits for a gradient of
        every parameter that requires one: after a backward that left one without, the step's gradients are
        not all averaged, and the next forward fails with "Expected to have finished reduction in the prior
        iteration", which names no parameter.
        """
        before = model.require_backward_grad_sync
        if not before and self._expected.get(id(model), True):  # in the caller's own no_sync(): it stays local
            yield  # (the batch-size search, whose steps must not wait on a rank that ran out of memory)
        else:
            model.require_backward_grad_sync = True  # for a forward inside (train_step)
            try:
                yield
            finally:
                model.require_backward_grad_sync = before
            if not model.require_forward_param_sync:  # DDP's own record: the last forward readied no reduction
                self.average_gradients(model)
        if id(model) in self._checked or self.find_unused:
            return
        params = [(name, p) for name, p in self.module(model).named_parameters() if p.requires_grad]
        unused = [name for name, p in params if p.grad is None]
        if len(unused) == len(params):  # this loss did not reach the model (another model's, of several): not yet
            return
        self._checked.add(id(model))
        if unused:
            raise ConfigError(
                f"under DDP every parameter that requires a gradient must get one from the loss, and {len(unused)} "
                f"got none in the first step: {few(unused, 5)}\nhint: freeze what the loss does not use "
                "(param.requires_grad_(False)) or leave it out of the model; for a model that uses other "
                "parameters in other steps, pass find_unused_parameters=True (--find-unused-parameters)"
            )

    @contextlib.contextmanager
    def accumulate_locally(self, model: nn.Module) -> Iterator[None]:
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        with model.no_sync():  # the forwards inside too: else DDP's reducer all-reduces in their backward
            # Nor a buffer broadcast in a forward: a rank that ran out of memory runs fewer forwards than the
            # others, and its broadcasts would pair with their other collectives. Buffers go in average_gradients.
            model.require_forward_param_sync = False
            yield

    def average_gradients(self, model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        if self.find_unused and params:  # a parameter one rank left without a gradient: zeros there, as DDP's
            had = all_reduce_sum(torch.tensor([p.grad is not None for p in params], device=params[0].device).int())
            for p, ranks in zip(params, had.tolist(), strict=True):
                if ranks and p.grad is None:
                    p.grad = torch.zeros_like(p)
        average_tensors([p.grad for p in params if p.grad is not None])
        module = self.module(model)
        broadcast_tensors([b for b in module.buffers()], src=0)  # as DDP does before a forward: rank 0's

    def module(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def save(
        self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, runtime_state: dict[str, Any],
        extra: dict[str, Any], plan: dict[str, Any], step: int | None,
    ) -> Checkpoint:  # fmt: skip
        def write() -> Checkpoint:  # the ranks hold the same weights: one copy, from rank 0
            return super(DDP, self).save(
                path, model, optimizer, runtime_state=runtime_state, extra=extra, plan=plan, step=step
            )

        return run_on_rank0(write, "writing the checkpoint")

    def save_weights(self, path: Path, model: nn.Module) -> None:
        run_on_rank0(lambda: whole.save_weights_file(path, self.module(model)), "writing the weights")
