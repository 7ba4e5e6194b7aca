"""One rank of a two-process DDP job whose model uses another head on each rank and at each step.

Run by test_ddp_unused.py as ``python ddp_unused_job.py OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. It trains ``TwoHeads`` for ``STEPS`` steps twice, with find_unused_parameters: through
the Runtime (DDP's reducer) and through the strategy's local accumulation (a micro-batched step that
averages the gradients itself); it writes each run's weights to OUT/{run}-rank{R}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import redline
from redline.runtime.strategy import build_strategy

STEPS = 3


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 2)])

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](torch.tanh(self.body(x)))


def head_for(rank: int, step: int) -> int:
    """Each rank its own head at step 0, both head 0 at step 1 (head 1 unused everywhere), swapped at step 2."""
    return [[0, 1], [0, 0], [1, 0]][step][rank]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 4, generator=gen), torch.randint(0, 2, (4,), generator=gen)


def initial() -> TwoHeads:
    torch.manual_seed(0)
    return TwoHeads()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    with redline.Runtime(devices="cpu", compile="off", precision="fp32", find_unused_parameters=True) as rt:
        rank = torch.distributed.get_rank()
        strategy = build_strategy("ddp", find_unused_parameters=True)  # the micro-batched path, by hand
        model, optimizer = strategy.wrap(initial(), sgd, device=torch.device("cpu"), precision="fp32")
        for step in range(STEPS):
            inputs, targets = batch(rank, step)
            with strategy.accumulate_locally(model):
                nn.functional.cross_entropy(model(inputs, head_for(rank, step)), targets).backward()
            strategy.average_gradients(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.save(strategy.module(model).state_dict(), out / f"local-rank{rank}.pt")

        model, optimizer = rt.setup(initial(), sgd)
        for step in range(STEPS):
            inputs, targets = batch(rank, step)
            with rt.autocast():
                loss = nn.functional.cross_entropy(model(inputs, head_for(rank, step)), targets)
            rt.backward(loss)
            rt.step(optimizer)
        torch.save(rt.module.state_dict(), out / f"runtime-rank{rank}.pt")
        (out / "strategy.txt").write_text(rt.explain().strategy.reason)


if __name__ == "__main__":
    main()
