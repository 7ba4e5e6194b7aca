"""The loss a bench row shows is its whole batch's, micro-batches or not, so the rows' losses compare."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.bench.loops import naive_runner, runtime_runner
from redline.bench.matrix import Setting
from redline.runtime.options import RuntimeOptions
from redline.task import Task


def test_a_row_with_micro_batches_shows_the_loss_of_its_whole_batch():
    # A tuned Plan with 2 micro-batches a step showed the loss of its last micro-batch, half the batch the
    # other rows' losses are of: the auto row's loss told apart from the others' for no reason of its own.
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    task = Task(
        model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)),
        loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y), batch_size=32, name="mlp",
    )  # fmt: skip
    setting = Setting("explicit", "cpu", "fp32", False, 32)
    whole = naive_runner(task, setting, seed=0)
    options = RuntimeOptions(devices="cpu", precision="fp32", compile="off", grad_accum=2)
    halves = runtime_runner(task, setting, seed=0, planned_steps=None, options=options)
    assert halves.micro_steps == 2
    first = [whole.run(1), halves.run(1)]  # the same model, the same 32 samples: one batch, or two halves of it
    assert first[1] == pytest.approx(first[0], rel=1e-5)
    assert halves.first_loss == pytest.approx(whole.first_loss, rel=1e-5)
    later = [whole.run(2), halves.run(2)]  # the same updates (the halves' gradients add up to the batch's)
    assert later[1] == pytest.approx(later[0], rel=1e-4)
