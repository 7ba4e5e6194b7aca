"""Engines for the server's tests: the real eager engine on tiny models, and a fake one that can stall or fail."""

import threading
import time

import numpy as np
import torch
from torch import nn

from redline.serve.engine import InferenceEngine, WarmUpStopped
from redline.serve.servable import Servable

POISON = 666.0  # a sample holding this value makes FakeEngine raise, as a model bug would


def linear_engine(max_batch_size=8, **servable):
    """The real engine on a seeded nn.Linear(3, 2)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return InferenceEngine(
        Servable(model=model, input_shape=(3,), **servable), device="cpu", precision="fp32",
        max_batch_size=max_batch_size,
    )  # fmt: skip


class Slow(nn.Module):
    """A linear layer that takes ``delay`` seconds per batch, so that requests pile up behind it."""

    def __init__(self, delay):
        super().__init__()
        self.delay = delay
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        time.sleep(self.delay)
        return self.linear(x)


class FakeEngine:
    """The InferenceEngine's interface, doubling its inputs; it can hold each batch until ``gate`` opens.

    Set ``broken`` to play a sticky device error; a sample holding POISON raises; ``warm_gate``
    holds the warm-up.
    """

    def __init__(self, *, input_shape=(3,), input_dtype="float32", max_batch_size=8, ready=True):
        self.servable = Servable(model=nn.Identity(), input_shape=input_shape, input_dtype=input_dtype)
        self.input_shape = input_shape
        self.max_batch_size = max_batch_size
        self.plan = {}
        self.device = torch.device("cpu")
        self.ready = ready
        self.broken = None
        self.gate = threading.Event()
        self.gate.set()
        self.warm_gate = threading.Event()
        self.warm_gate.set()
        self.warm_error = None
        self.batches = []  # the sizes of the batches run
        self.threads = set()  # the threads predict ran in

    def warm_up(self, stop=None):
        deadline = time.monotonic() + 10
        while not self.warm_gate.wait(0.01) and time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                raise WarmUpStopped("stopped")
        if self.warm_error is not None:
            raise self.warm_error
        self.ready = True

    def predict(self, batch):
        self.threads.add(threading.current_thread().name)
        self.gate.wait(10)
        inputs = torch.as_tensor(np.asarray(batch)) if not isinstance(batch, torch.Tensor) else batch
        self.batches.append(inputs.shape[0])
        if bool((inputs == POISON).any()):
            raise RuntimeError("the model hit a poisoned sample")
        return inputs.float() * 2
