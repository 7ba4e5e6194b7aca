"""The precision `redline memory` weighs a step in: auto's is measured on this machine, as `redline train` runs it."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from devices import H100
from redline.hardware.device import probe_device
from redline.memory.fit import fit_precision


def small_task() -> redline.Task:
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    return redline.Task(model=lambda: nn.Linear(8, 1), loss_fn=nn.functional.mse_loss, train_data=data, batch_size=8)


def test_auto_on_this_machine_is_the_measured_choice_and_elsewhere_the_rule_said_so(bf16_measured_faster):
    cpu = probe_device(torch.device("cpu"))
    here = fit_precision(small_task(), "auto", cpu, here=True, batch_size=None)
    assert here.value == "bf16-mixed"  # the rule keeps fp32 on a CPU
    assert here.reason.startswith("measured: bf16-mixed ran 1.43x fp32")
    again = fit_precision(small_task(), "auto", cpu, here=True, batch_size=8)  # the task's batch: train's trial
    assert again.value == "bf16-mixed" and "cached from" in again.reason
    afar = fit_precision(small_task(), "auto", H100, here=False, batch_size=None)
    assert afar.value == "bf16-mixed" and afar.reason.endswith(
        "not measured: a trial runs on this machine's own device only"
    )
    assert fit_precision(small_task(), "fp32", cpu, here=True, batch_size=None).reason == "requested"
    assert bf16_measured_faster == [["bf16-mixed"]]  # one trial: the cache served the second, nothing the others
