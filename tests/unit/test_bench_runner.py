"""A bench runner's first loss: the whole first batch's, however many micro-batches a step takes; and what torch
says as a warm-up's compile fails."""

import warnings

import pytest
import torch
from torch import nn

from redline.bench.loops import Runner, quiet_failed_ops
from redline.bench.matrix import Setting


def test_a_micro_batched_runners_first_loss_is_its_first_steps_mean_as_a_whole_batch_has_it():
    losses = iter([2.0, 4.0, 9.0, 9.0, 9.0, 9.0])
    batches = [(torch.zeros(2, 3), torch.zeros(2))] * 6
    setting = Setting(kind="explicit", device="cpu", precision="bf16-mixed", compile=False, batch_size=4)
    runner = Runner(setting, nn.Linear(3, 1), lambda inputs, targets: torch.tensor(next(losses)), batches,
                    micro_steps=2)  # fmt: skip
    runner.run(1)
    assert runner.first_loss == 3.0  # (2 + 4) / 2: the first micro-batch alone (2.0) is half the batch
    runner.run(2)
    assert runner.first_loss == 3.0
    assert runner.first_batch is not None and runner.first_batch[0].shape == (2, 3)


@pytest.mark.parametrize("raised, shown", [(KeyboardInterrupt(), False), (RuntimeError("a bug in the backward"), True)])
def test_a_ctrl_c_as_a_compile_traces_the_backward_is_not_said_to_be_an_error_of_the_users_model(raised, shown):
    """AOTAutograd traces a compile's backward in anomaly mode, where an error leaving a backward node warns "Error
    detected in ...Backward" with the user's forward line: a bug of theirs is, their own Ctrl-C in a warm-up is not."""

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise raised

    with warnings.catch_warnings(record=True) as seen, pytest.raises(type(raised)):
        warnings.simplefilter("always")
        with quiet_failed_ops(), torch.autograd.detect_anomaly(check_nan=False):  # as the compile's trace runs it
            Fails.apply(torch.ones(2, requires_grad=True)).sum().backward()
    said = [w for w in seen if str(w.message).startswith("Error detected in FailsBackward")]
    assert bool(said) == shown
