"""What a training step moves besides the weights, kept at its start: a step that fails is put back to it, so the
checkpoint of the steps so far holds what the unbroken run had there, and a resume redoes the step as it ran.

A step's forward draws random numbers (dropout's masks, an augmentation reading its batch) and moves its batch norms'
running statistics; a failed step's draws and statistics would otherwise be saved with the steps before it (a NaN
batch's statistics poison every later evaluation, and the resumed run's masks differ from the unbroken run's).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from redline.runtime.checkpointing import running_stats
from redline.runtime.loading import GatheredTensors


class StepStart:
    """The random streams a checkpoint keeps (Python's, NumPy's, torch's, the run's CUDA device's) and the model's
    batch norms' running statistics, as they stood at the start of the step under way.

    The statistics are copied into storage allocated once, in one foreach op (none for a model without batch norms);
    torch reads a random stream's state only into a new tensor, a few kilobytes, which is all a step's keeping
    allocates. Python's and NumPy's streams are kept only where ``host_streams`` (``draws_here``): reading them
    costs 30 us a step (NumPy's 23), a tenth of a small model's step on a GPU, and what most often draws from them
    in a step is an augmentation or a collate_fn run in this process; a model or loss drawing from them (a layer
    dropped by ``random.random()``) resumes on the draws after a failed step where they are not kept.
    """

    def __init__(self, model: nn.Module, device: torch.device, *, host_streams: bool = True) -> None:
        self.stats = running_stats(model)
        self.saved_stats = [t.clone() for t in self.stats]
        self.cuda = device if device.type == "cuda" else None
        self.host_streams = host_streams
        self.streams: tuple[Any, ...] = ()

    def keep(self) -> None:
        """Keep the random streams and the statistics as they stand now, the step's start."""
        if self.stats:
            torch._foreach_copy_(self.saved_stats, self.stats)
        cuda = torch.cuda.get_rng_state(self.cuda) if self.cuda and torch.cuda.is_initialized() else None
        host = (random.getstate(), np.random.get_state()) if self.host_streams else (None, None)
        self.streams = (*host, torch.get_rng_state(), cuda)

    def put_back(self) -> None:
        """Put the random streams and the statistics back as ``keep`` last kept them."""
        if self.stats:
            with torch.no_grad():
                torch._foreach_copy_(self.stats, self.saved_stats)
        if not self.streams:
            return
        python, numpy, cpu, cuda = self.streams
        if python is not None:
            random.setstate(python)
            np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None and self.cuda is not None:
            torch.cuda.set_rng_state(cuda, self.cuda)


def draws_here(loader: Any) -> bool:
    """Whether this process reads ``loader``'s items through the dataset's own code (no loader workers, and not
    gathered from tensors whole), where an augmentation or a collate_fn may draw from Python's or NumPy's streams."""
    return getattr(loader, "num_workers", 0) == 0 and not isinstance(getattr(loader, "dataset", None), GatheredTensors)
