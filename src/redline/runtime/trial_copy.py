"""A trial candidate's copy of the model, training on the one batch, and the turns its copies take.

A trial times its candidates in blocks that take turns (runtime/trial.py). Each copy held its gradients and its
optimizer's state (AdamW's: twice the weights) while the others ran, so a trial of fp32 and bf16 needed about
twice the memory of the run it decides for: on a machine where a bf16 run fit, its trial ran out of memory for
bf16 and kept fp32. Here one copy at a time holds training state: when its turn ends, a copy lets go of its
gradients and its optimizer (built anew from the factory when its turn comes again, its state filled in the
block's untimed settling step) and keeps its weights: on the device where it has room for the next copy's training
(``room_beside``), else on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from redline.plan.precision import PrecisionName
from redline.runtime.attention import prefer_kernel
from redline.runtime.contract import check_loss
from redline.runtime.layout import lay_out, nchw_outputs
from redline.runtime.optimizer import build_optimizer
from redline.runtime.precision import Precision
from redline.runtime.transfer import move_to


class Turns:
    """Which copy of a trial holds its training state now: at most one."""

    def __init__(self) -> None:
        self.active: TrainingCopy | None = None

    def take(self, copy: TrainingCopy) -> None:
        """Give ``copy`` its turn, ending the turn of the copy that had it."""
        if self.active is not copy:
            self.end()
            copy.wake()
            self.active = copy

    def end(self, *, offload: bool = True) -> None:
        """End the turn of the copy that has it, if any: it lets go of its training state (``TrainingCopy.park``)."""
        if self.active is not None:
            active, self.active = self.active, None
            active.park(offload=offload)


class TrainingCopy:
    """One candidate's copy of the run's model, training on one batch in the precision and attention kernel of its
    ``form`` ("auto": torch's pick); ``step()`` takes its turn first (``Turns``), so the trial holds one copy's
    training state at a time.

    The copy trains as the run would: freeing its gradients where the Runtime does (``zero_after_step``: after the
    step, as on a GPU; else before backward, as on a CPU), with ``channels_last`` laid out so, model and 4-d inputs,
    and with ``inside`` (auto's NHWC, which falls back to NCHW) its outputs handed back NCHW as auto's are.
    """

    def __init__(
        self,
        copied: nn.Module,
        optimizer: Callable[[Any], torch.optim.Optimizer],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        batch: tuple[Any, Any],
        device: torch.device,
        form: tuple[str, str],
        turns: Turns,
        *,
        zero_after_step: bool,
        channels_last: bool = False,
        inside: bool = False,
    ) -> None:
        self.model, self.factory, self.loss_fn, self.device, self.turns = copied, optimizer, loss_fn, device, turns
        self.inputs, self.targets = batch
        self.zero_after_step = zero_after_step
        copied.to(device).train()
        if channels_last:
            lay_out(copied, None, channels_last=True)
            self.inputs = move_to(self.inputs, device, channels_last=True)
        if channels_last and inside:  # as runtime/layout.py hooks the run's model: a loss's .view sees NCHW strides
            copied.register_forward_hook(nchw_outputs)
        self.optimizer: torch.optim.Optimizer | None = build_optimizer(optimizer, copied)  # the checks setup() makes
        precision_name, self.kernel = form
        self.precision = Precision(cast(PrecisionName, precision_name), device)

    def step(self) -> float:
        """One training step, in the Runtime's order (a CPU re-faults memory freed too early); return its loss."""
        self.turns.take(self)
        opt = self.optimizer
        assert opt is not None  # woken by its turn
        if not self.zero_after_step:
            opt.zero_grad(set_to_none=True)
        kernel = prefer_kernel(self.kernel) if self.kernel != "auto" else contextlib.nullcontext()
        with kernel, self.precision.autocast():
            loss = check_loss(self.loss_fn(self.model(self.inputs), self.targets), training=True)
        self.precision.backward(loss)
        self.precision.step(opt, None)
        if self.zero_after_step:
            opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def wake(self) -> None:
        """Bring the weights back to the device and build the optimizer anew, where its turn ended before."""
        if self.optimizer is None:
            self.model.to(self.device)
            self.optimizer = build_optimizer(self.factory, self.model)

    def park(self, *, offload: bool = True) -> None:
        """Let go of the gradients and the optimizer's state, and, with ``offload``, move the weights off an
        accelerator short of memory (a copy the trial is done with keeps them there: they go with it)."""
        self.model.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            self.optimizer.state.clear()  # at once: torch's AdamW sits in a reference cycle until a collection
            self.optimizer = None
        if offload and self.device.type != "cpu" and not room_beside(self.model, self.device):
            self.model.to("cpu")


# The next copy's gradients and AdamW state take about three times its weights: with room for four, a parked copy's
# weights stay on the device, sparing two moves of them a turn (seconds a trial for a model of a few GB).
ROOM_FACTOR = 4


def room_beside(model: nn.Module, device: torch.device, free: int | None = None) -> bool:
    """Whether ``device`` (``free`` bytes of it free; read from CUDA where None) has room for the next copy's training
    state beside ``model``'s weights kept on it; False where its free memory cannot be read."""
    if free is None:
        if device.type != "cuda":
            return False
        free = int(torch.cuda.mem_get_info(device)[0])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return free >= ROOM_FACTOR * weights
