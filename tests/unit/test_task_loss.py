"""A task's loss that broadcasts its targets against outputs of another shape is refused at its first call."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from redline.errors import TaskError
from redline.runtime import loss as loss_module
from redline.runtime.loss import task_loss


def test_targets_broadcast_against_outputs_of_another_shape_are_refused_with_both_shapes():
    outputs = torch.randn(16, 1, requires_grad=True)

    def mse(o, t):  # a function of the task's own: each test's is new, so its first call is checked
        return nn.functional.mse_loss(o, t)

    with pytest.raises(TaskError) as refused:
        task_loss(mse, outputs, torch.randn(16))  # the classic: (16, 1) against (16,), a (16, 16) loss
    said = str(refused.value)
    assert said.startswith(
        "task.loss_fn(outputs, targets) broadcast targets of shape (16,) against outputs of shape (16, 1), which "
        "gives a wrong loss (torch: Using a target size (torch.Size([16])) that is different to the input size"
    )
    assert "\nhint: make them one shape: a model with as many outputs as each target has values" in said
    assert mse not in loss_module._CHECKED  # refused: its next call is checked again


def test_a_loss_of_matching_shapes_is_checked_once_then_called_plainly():
    outputs, targets = torch.randn(8, 3, requires_grad=True), torch.randn(8, 3)

    def mse(o, t):
        return nn.functional.mse_loss(o, t)

    loss = task_loss(mse, outputs, targets)
    assert torch.equal(loss, nn.functional.mse_loss(outputs, targets)) and mse in loss_module._CHECKED
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked already, a later call runs as it is: torch's warning, not a refusal
        with pytest.raises(UserWarning, match="Using a target size"):
            task_loss(mse, outputs, torch.randn(8, 1))
    with pytest.raises(TaskError, match=r"returned a tensor of shape \(8, 3\); expected a scalar"):
        task_loss(lambda o, t: nn.functional.mse_loss(o, t, reduction="none"), outputs, targets)  # check_loss's


def test_another_warning_a_callers_filter_made_an_error_passes_as_it_is():
    outputs, targets = torch.randn(4, 1, requires_grad=True), torch.randn(4, 1)

    def warns(o, t):
        warnings.warn("a deprecation of the user's own", UserWarning, stacklevel=1)
        return nn.functional.mse_loss(o, t)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as `python -W error` or pytest's -W error make every warning
        with pytest.raises(UserWarning, match="a deprecation of the user's own"):
            task_loss(warns, outputs, targets)  # not said to be a broadcast of shapes that match
