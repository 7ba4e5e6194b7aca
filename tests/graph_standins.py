"""Stand-ins for CUDA graphs on a CPU: a capture that records its samples and hands back a "graph" running the
module's own forward, and the small model the graph tests capture."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.layer(x.float())


class Capture:
    """Stands in for capture_graphs: records each sample, returns a "graph" that runs the module's own forward."""

    def __init__(self, fail: Exception | None = None, scale: float = 1.0, static: bool = False) -> None:
        self.samples: list[tuple[torch.Tensor, ...]] = []
        self.replays = 0  # the comparison with the module's own forward replays once too
        self.fail, self.scale, self.static = fail, scale, static

    def __call__(self, module: nn.Module, sample: tuple[torch.Tensor, ...]):
        self.samples.append(sample)
        if self.fail is not None:
            raise self.fail
        own = module.forward
        buffer: list[torch.Tensor] = []

        def replay(*args):
            self.replays += 1
            out = own(*args) * self.scale  # scale != 1: a graph that computes something else
            if not self.static:
                return out
            if not buffer:  # a real graph's output: one buffer, overwritten by each replay
                buffer.append(torch.empty_like(out.detach()))
            return _Static.apply(out, buffer[0])

        return replay


class _Static(torch.autograd.Function):
    """Hands out the graph's output buffer itself, as torch's graphed function does (its gradient passes through)."""

    @staticmethod
    def forward(ctx, out, buffer):
        buffer.copy_(out)
        return out.detach().new_empty(0).set_(buffer.untyped_storage(), 0, buffer.shape, buffer.stride())

    @staticmethod
    def backward(ctx, grad):
        return grad, None
