"""The one check every loss passes before backward: a one-element tensor that carries a gradient."""

from __future__ import annotations

from typing import Any

import torch

from redline.errors import TaskError

TASK_LOSS = "task.loss_fn(outputs, targets) returned"


def check_loss(loss: Any, *, training: bool, source: str = TASK_LOSS) -> torch.Tensor:
    """Return ``loss`` if it is a one-element tensor (with a gradient when ``training``), else say what it is.

    Reads the tensor's shape and flags only: no device sync. ``source`` starts the message.
    """
    if loss is None:  # outputs.loss of a model given no labels: a Hugging Face model computes its loss only then
        raise TaskError(
            f"{source} None; expected a scalar tensor\nhint: a model that returns its own loss (a Hugging Face "
            "model's outputs.loss) computes it only when given the targets: pass them (labels=...), or compute the "
            "loss from the outputs (e.g. F.cross_entropy(outputs.logits, targets)); a function gives None where it "
            "has no `return`"
        )
    if isinstance(loss, tuple | list) and loss and isinstance(loss[0], torch.Tensor):  # `return loss, logits`
        raise TaskError(
            f"{source} a {type(loss).__name__} of {len(loss)} (the first a tensor of shape {tuple(loss[0].shape)}); "
            "expected the loss alone, a scalar tensor\nhint: return only the loss (`return loss`, not "
            "`return loss, outputs`), and compute what else you log outside"
        )
    if not isinstance(loss, torch.Tensor):
        text = repr(loss)
        raise TaskError(
            f"{source} {type(loss).__name__} {text[:40]}; expected a scalar tensor\n"
            "hint: compute the loss with torch operations on the outputs (e.g. F.cross_entropy(outputs, targets)), "
            "not with Python numbers or .item()"
        )
    if loss.numel() != 1:
        raise TaskError(
            f"{source} a tensor of shape {tuple(loss.shape)}; expected a scalar (one value for the batch)\n"
            "hint: reduce the per-sample losses, e.g. .mean(), or use the loss's default reduction='mean'"
        )
    if training and not loss.requires_grad:
        raise TaskError(
            f"{source} a tensor that does not depend on the model's parameters (requires_grad=False)\n"
            "hint: build the loss from the model's outputs without .detach(), .item() or torch.no_grad()"
        )
    return loss
