"""A run whose step's FLOPs cannot be counted (a branch on the data's values, which meta tensors cannot take) says
so: its MFU note read "no datasheet peak for a CPU", and the measured-peak row went missing without a word."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.cli.train import summary_rows
from redline.train.throughput import NOT_COUNTED
from redline.train.trainer import Trainer


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else self.b(x)


def test_a_step_whose_flops_cannot_be_counted_says_so_in_the_mfu_and_measured_peak_rows():
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    task = redline.Task(model=Branchy, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=8)
    with Trainer(task, max_steps=4, progress=False, trial="off") as trainer:
        summary = trainer.fit()
    assert summary.flops_per_step is None and summary.mfu_note is not None
    assert summary.mfu_note.startswith(f"{NOT_COUNTED}: they are counted on meta tensors")
    rows = dict(summary_rows(summary))
    assert rows["MFU"] == rows["of measured matmul peak"] == f"n/a ({summary.mfu_note})"
