"""Models that run out of memory above a batch size, as a full GPU would: in forward, or in backward.

They raise the real ``torch.OutOfMemoryError``, so the Runtime's recovery runs as it would on CUDA.
``oom_task`` is a Task spec for the Trainer and the command line (``oom_models.py:oom_task``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline


def out_of_memory(samples: int) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (a batch of {samples})")


class ForwardLimit(nn.Module):
    """A small MLP whose training forward runs out of memory above ``limit`` samples (None: never).

    It holds a buffer, as a model with BatchNorm does: DDP broadcasts buffers in a forward, which a
    rank that ran out of memory would run fewer times than the others.
    """

    def __init__(self, limit: int | None) -> None:
        super().__init__()
        self.limit = limit
        self.body = nn.Linear(6, 16)
        self.head = nn.Linear(16, 3)
        self.register_buffer("scale", torch.ones(16))
        self.sizes: list[int] = []  # the batch size of every training forward that ran

    def over(self, x: torch.Tensor) -> bool:
        return self.training and not x.is_meta and self.limit is not None and x.shape[0] > self.limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.over(x):
            raise out_of_memory(x.shape[0])
        if self.training and not x.is_meta:
            self.sizes.append(x.shape[0])
        return self.head(torch.tanh(self.body(x)) * self.scale)


class _FailingBackward(torch.autograd.Function):
    """The identity, whose backward runs out of memory above ``limit`` samples."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, limit: int | None) -> torch.Tensor:  # type: ignore[override]
        ctx.limit = limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        if ctx.limit is not None and grad.shape[0] > ctx.limit:
            raise out_of_memory(grad.shape[0])
        return grad, None


class BackwardLimit(ForwardLimit):
    """The same MLP; its backward runs out of memory above ``limit`` samples, after the head's gradients exist."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not x.is_meta:
            self.sizes.append(x.shape[0])
        hidden = torch.tanh(self.body(x))
        limit = self.limit if self.training and not x.is_meta else None
        return self.head(_FailingBackward.apply(hidden, limit) * self.scale)


def make_model(kind: str = "forward", limit: int | None = None, seed: int = 0) -> ForwardLimit:
    torch.manual_seed(seed)
    return (ForwardLimit if kind == "forward" else BackwardLimit)(limit)


def make_data(samples: int = 64, seed: int = 3) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, 6, generator=gen), torch.randint(0, 3, (samples,), generator=gen))


def oom_task(kind: str = "forward", limit: int | None = 5, batch: int = 16) -> redline.Task:
    """A Task whose model runs out of memory (in ``kind``) above ``limit`` samples."""
    return redline.Task(
        model=lambda: make_model(kind, limit),
        loss_fn=nn.functional.cross_entropy,
        train_data=make_data(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        batch_size=batch,
        epochs=1,
        name="oom",
    )


class RecomputeLimit(nn.Module):
    """Two repeated blocks whose training forward runs out of memory at any batch unless their activations are
    recomputed (activation checkpointing): a model that fits only that way."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from redline.runtime.checkpointing import is_checkpointed

        if self.training and torch.is_grad_enabled() and not is_checkpointed(self.blocks[0]):
            raise out_of_memory(x.shape[0])
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)
