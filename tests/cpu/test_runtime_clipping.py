"""A loop that clips, or reads the gradient norm, itself: rt.clip_grad_norm_ sees the true gradients in every precision.

Under fp16 the gradients stay multiplied by the loss scale until the step; torch's own clip_grad_norm_ there
would clip them to a norm 65,536 times too small. The forward here runs in fp32 (no autocast), so scaling by a
power of two and back is exact and the steps equal the plain loop's.
"""

import pytest
import torch
from torch import nn

import redline

CLIP = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    inputs, targets = batch(step)
    return nn.functional.mse_loss(model(inputs), targets)


def plain_loop(steps: int, accum: int) -> tuple[nn.Module, list[float]]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for step in range(steps):
        (loss_of(model, step) / accum).backward()
        if step % accum == accum - 1:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
    return model, norms


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
@pytest.mark.parametrize("accum", [1, 2])
def test_clipping_in_the_loop_steps_as_the_plain_loop_and_returns_the_true_norm(precision, accum):
    expected, expected_norms = plain_loop(4, accum)
    rt = redline.Runtime(devices="cpu", precision=precision, grad_accum=accum, compile="off")
    model, optimizer = rt.setup(make_model(), lambda params: torch.optim.SGD(params, lr=0.5))
    norms = []
    for step in range(4):
        rt.backward(loss_of(model, step))
        norm = rt.clip_grad_norm_(optimizer, CLIP)
        assert (norm is None) == (step % accum != accum - 1)  # mid-accumulation the gradients are not whole yet
        if norm is not None:
            norms.append(float(norm))
        assert rt.step(optimizer) == (norm is not None)
    assert norms == pytest.approx(expected_norms, rel=1e-6)
    assert min(norms) > CLIP  # every step was clipped: the check compares clipped steps
    for mine, theirs in zip(model.parameters(), expected.parameters(), strict=True):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6)


def test_clipping_in_the_loop_and_the_clip_option_together_unscale_once():
    """clip_grad_norm= clips again at the step: the gradients were unscaled once, and the step is the plain one."""
    expected, _ = plain_loop(2, 1)
    rt = redline.Runtime(devices="cpu", precision="fp16-mixed", clip_grad_norm=CLIP, compile="off")
    model, optimizer = rt.setup(make_model(), lambda params: torch.optim.SGD(params, lr=0.5))
    for step in range(2):
        rt.backward(loss_of(model, step))
        assert rt.clip_grad_norm_(optimizer, float("inf")) is not None  # reads the norm, clips nothing
        assert rt.step(optimizer)
    assert rt.skipped_steps == 0
    for mine, theirs in zip(model.parameters(), expected.parameters(), strict=True):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6)
