"""A probe forward (the precision and layout checks' look at a step's inputs) leaves the model as it found it."""

import pytest
import torch
from torch import nn

from redline.runtime.probe import probe_forward


class Recurrent(nn.Module):
    """Truncated backpropagation through time: the hidden state carried in a plain attribute between forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.h: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.cell(x, self.h)
        self.h = h.detach()
        return h


def test_a_state_kept_in_an_attribute_is_the_steps_own_after_a_probe():
    # the probes advanced self.h: the fp32 probe started from the bf16 probe's state (a 21.8% "departure"), and the
    # step's own forward from the probes'
    torch.manual_seed(0)
    net, x = Recurrent(), torch.randn(2, 3)
    probe_forward(net, (x,), {})
    assert net.h is None  # set by the probe where there was none: taken off
    net(x)
    carried = net.h
    first = probe_forward(net, (x,), {})
    assert net.h is carried  # replaced by the probe: put back
    assert torch.equal(first, probe_forward(net, (x,), {}))  # each probe starts from the step's state


class Physics(nn.Module):
    """A physics-informed net: its forward differentiates its output with respect to its input."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.net(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return u + du


def test_a_forward_that_differentiates_itself_is_probed_with_autograd_and_its_outputs_detached():
    # without autograd it failed ("element 0 of tensors does not require grad"), in fp32 as in bf16, and the
    # precision check blamed bf16 for it
    net = Physics()
    x = torch.linspace(0, 1, 5).unsqueeze(1).requires_grad_(True)
    out = probe_forward(net, (x,), {})
    assert not out.requires_grad and torch.allclose(out, net(x).detach())
    assert x.grad is None and all(p.grad is None for p in net.parameters())  # nothing was back-propagated


def test_a_failure_of_another_kind_is_not_run_again_with_autograd():
    class Broken(nn.Module):
        calls = 0

        def forward(self, x):
            Broken.calls += 1
            raise RuntimeError("no kernel for this dtype")

    with pytest.raises(RuntimeError, match="no kernel"):
        probe_forward(Broken(), (torch.ones(1),), {})
    assert Broken.calls == 1
