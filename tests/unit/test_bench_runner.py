"""A bench runner's first loss: the whole first batch's, however many micro-batches a step takes."""

import torch
from torch import nn

from redline.bench.loops import Runner
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
