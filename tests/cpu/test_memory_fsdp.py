"""FSDP's row of estimate_memory under mixed precision: the parameters are gathered in bf16, so autocast casts none."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.memory.estimate import estimate_memory
from redline.task import Task

WIDTH = 1024
BF16_WEIGHT = WIDTH * WIDTH * 2  # one block's weight, copied to bf16 by autocast on one GPU


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()  # no biases: autocast's copy of a bias is not saved for backward, only a weight's is
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.ReLU()) for _ in range(4))
        self.head = nn.Linear(WIDTH, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def blocks(batch_size: int) -> Task:
    data = TensorDataset(torch.randn(64, WIDTH), torch.randint(0, 16, (64,)))
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731 (no state: the peak is the activations')
    return Task(model=Blocks, loss_fn=nn.functional.cross_entropy, train_data=data, batch_size=batch_size,
                optimizer=sgd, name="blocks")  # fmt: skip


def test_fsdp_under_mixed_precision_holds_no_autocast_copy_of_its_parameters() -> None:
    """Before, the FSDP row kept the one-GPU trace's bf16 copies of the weights among its activations, beside the
    bf16 blocks it gathers: the weights' low precision counted twice."""
    one = estimate_memory(blocks(4096), precision="bf16-mixed", target="cuda")
    sharded = estimate_memory(blocks(8192), precision="bf16-mixed", strategy="fsdp", world_size=2, target="cuda")
    # the peak comes in the last block's backward, as its weight's gradient is made: its copy and the head's are
    # freed by then (their backward ran), the three blocks' below it are still saved for theirs
    assert one.activations - sharded.activations == 3 * BF16_WEIGHT
    parts = sharded.params + sharded.buffers + sharded.gradients + sharded.optimizer_state + sharded.activations
    assert sharded.peak == parts  # taken out of the peak too


def test_fsdp_in_fp32_and_ddp_keep_the_traced_activations() -> None:
    one = estimate_memory(blocks(4096), precision="fp32", target="cuda")
    sharded = estimate_memory(blocks(8192), precision="fp32", strategy="fsdp", world_size=2, target="cuda")
    assert sharded.activations == one.activations
    mixed = estimate_memory(blocks(4096), precision="bf16-mixed", target="cuda")
    ddp = estimate_memory(blocks(8192), precision="bf16-mixed", strategy="ddp", world_size=2, target="cuda")
    assert ddp.activations == mixed.activations  # DDP keeps fp32 parameters: autocast copies them as on one GPU
