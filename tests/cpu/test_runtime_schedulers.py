"""LR schedulers in the user's own loop under gradient accumulation: rt.step steps the optimizer once a cycle."""

import pytest
import torch
from torch import nn

import redline


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return nn.functional.mse_loss(model(torch.randn(8, 4, generator=gen)), torch.randn(8, 2, generator=gen))


@pytest.mark.parametrize("gated", [False, True])
def test_a_chained_scheduler_under_accumulation_is_paced_by_the_schedulers_it_chains(gated, caplog):
    # A ChainedScheduler has no last_epoch of its own: the pace check's read of it raised AttributeError at rt.step.
    rt = redline.Runtime(devices="cpu", grad_accum=2, compile="off")
    model, optimizer = rt.setup(make_model(), lambda params: torch.optim.SGD(params, lr=0.5))
    chained = torch.optim.lr_scheduler.ChainedScheduler(
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9),
        ]
    )
    with caplog.at_level("WARNING", logger="redline"):
        for step in range(8):
            rt.backward(loss_of(model, step))
            if rt.step(optimizer) or not gated:
                chained.step()
    warned = [r.getMessage() for r in caplog.records if "LR scheduler" in r.getMessage()]
    assert len(warned) == (0 if gated else 1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 0.9 ** (4 if gated else 8))


@pytest.mark.parametrize("gated", [False, True])
def test_a_scheduler_stepped_after_every_call_under_accumulation_is_warned_of_once(gated, caplog):
    """A loop ported from one without grad_accum steps its scheduler after each rt.step: with grad_accum=4 the
    schedule ran four times too fast, with no word. Stepped when rt.step says the optimizer stepped, it is right."""
    rt = redline.Runtime(devices="cpu", grad_accum=4, compile="off")
    model, optimizer = rt.setup(make_model(), lambda params: torch.optim.SGD(params, lr=0.5))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    with caplog.at_level("WARNING", logger="redline"):
        for step in range(16):
            rt.backward(loss_of(model, step))
            stepped = rt.step(optimizer)
            if stepped or not gated:
                scheduler.step()
    warned = [r.getMessage() for r in caplog.records if "LR scheduler" in r.getMessage()]
    if gated:
        assert warned == [] and scheduler.last_epoch == 4
    else:
        assert len(warned) == 1 and "StepLR stepped 4 times over one optimizer step" in warned[0]
        assert "if rt.step(optimizer): scheduler.step()" in warned[0]
