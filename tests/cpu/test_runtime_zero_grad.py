"""A loop ported from one without accumulation zeroes its gradients before each batch: under grad_accum that drops
the cycle's earlier batches, and every step would take the last one alone, with no error."""

import pytest
import torch
from torch import nn

import redline
from redline.errors import ConfigError


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return nn.functional.mse_loss(model(torch.randn(8, 4, generator=gen)), torch.randn(8, 2, generator=gen))


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("how", ["zero_grad", "grad = None", "zero_grad(set_to_none=False)", "grad.zero_()"])
def test_freeing_the_gradients_amid_an_accumulation_cycle_is_refused_with_the_fix(how):
    rt = redline.Runtime(devices="cpu", grad_accum=2, compile="off")
    model, optimizer = rt.setup(nn.Linear(4, 2), sgd)
    optimizer.zero_grad()  # before any backward: nothing accumulated yet, nothing lost
    rt.backward(loss_of(model, 0))
    assert not rt.step(optimizer)
    if how == "zero_grad":
        optimizer.zero_grad()
    elif how == "zero_grad(set_to_none=False)":  # the gradients stay, zeroed in place
        optimizer.zero_grad(set_to_none=False)
    elif how == "grad.zero_()":
        model.weight.grad.zero_()  # one of them is enough to lose the first batch
    else:
        for p in model.parameters():
            p.grad = None
    with pytest.raises(ConfigError, match=r"(?s)first 1 batches of this accumulation cycle.*hint: drop optimizer"):
        rt.backward(loss_of(model, 1))


def test_the_runtimes_own_freeing_and_a_second_models_backward_are_not_taken_for_it():
    """rt.step frees the gradients after a real step; a second model's backward between a model's batches leaves
    them; a load drops the cycle begun, on purpose."""
    rt = redline.Runtime(devices="cpu", grad_accum=2, compile="off")
    first, opt_first = rt.setup(nn.Linear(4, 2), sgd)
    second, opt_second = rt.setup(nn.Linear(4, 2), sgd)
    stepped = []
    for step in range(4):
        rt.backward(loss_of(first, step))
        stepped.append(rt.step(opt_first))
        rt.backward(loss_of(second, step))
        stepped.append(rt.step(opt_second))
    assert stepped == [False, False, True, True] * 2
    one = redline.Runtime(devices="cpu", grad_accum=2, compile="off")
    model, optimizer = one.setup(nn.Linear(4, 2), sgd)
    one.backward(loss_of(model, 0))
    assert not one.step(optimizer)
    one.load_state_dict(one.state_dict())  # drops the cycle begun: its gradients are freed
    one.backward(loss_of(model, 1))
    assert not one.step(optimizer)  # a fresh cycle: its first batch
