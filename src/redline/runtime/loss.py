"""The one check every loss passes before backward: a one-element tensor that carries a gradient; and a task's loss
function's first call checked for targets it broadcast against outputs of another shape (``task_loss``)."""

from __future__ import annotations

import contextlib
import re
import warnings
import weakref
from collections.abc import Callable
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


# torch's warning where an elementwise loss (mse, l1, smooth_l1, huber, binary cross-entropy) broadcasts the targets
# against outputs of another shape: outputs (16, 1) and targets (16,) give a (16, 16) loss, trained without an error
BROADCAST = r"Using a target size .* that is different to the input size"
_CHECKED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()  # the loss functions whose first call passed


def task_loss(loss_fn: Callable[..., Any], outputs: Any, targets: Any) -> torch.Tensor:
    """``loss_fn(outputs, targets)``, checked as the task's training loss (``check_loss``). A loss function's first
    call in the process (one that cannot be weakly referenced: each call) is made with torch's broadcasting warning
    (``BROADCAST``) as an error: a loss of the wrong shape's targets that would train on, wrongly, is refused."""
    if loss_fn in _CHECKED:
        return check_loss(loss_fn(outputs, targets), training=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=BROADCAST, category=UserWarning)
        try:
            loss = loss_fn(outputs, targets)
        except UserWarning as exc:
            if not re.search(BROADCAST, str(exc)):  # another warning a filter of the caller's made an error
                raise
            raise TaskError(
                f"task.loss_fn(outputs, targets) broadcast targets {_shape(targets)} against outputs {_shape(outputs)}"
                f", which gives a wrong loss (torch: {str(exc).split('. ')[0]})\nhint: make them one "
                "shape: a model with as many outputs as each target has values, or targets shaped as the outputs "
                "(targets.view(-1, 1) for one output); where the broadcast is meant, expand the targets in loss_fn"
            ) from exc
    with contextlib.suppress(TypeError):  # not weakly referable (a builtin): checked at each call
        _CHECKED.add(loss_fn)
    return check_loss(loss, training=True)


def _shape(value: Any) -> str:
    return f"of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"of type {type(value).__name__}"
