"""The Precision object on its own: autocast, loss scaling in backward and step, its state."""

import copy

import pytest
import torch
from torch import nn

from redline.runtime.precision import Precision


def model_and_loss(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    inputs, targets = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    return model, nn.functional.cross_entropy(model(inputs), targets)


def test_fp32_autocasts_nothing_and_steps_as_the_plain_loop():
    precision = Precision("fp32", "cpu")
    with precision.autocast():
        assert not torch.is_autocast_enabled("cpu")
    model, loss = model_and_loss()
    plain, plain_loss = model_and_loss()
    initial = copy.deepcopy(model.state_dict())
    precision.backward(loss)
    precision.step(torch.optim.SGD(model.parameters(), lr=0.5), clip=None)
    plain_loss.backward()
    torch.optim.SGD(plain.parameters(), lr=0.5).step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    assert any(not torch.equal(initial[k], v) for k, v in model.state_dict().items())
    assert precision.scaler is None and precision.state_dict() == {}


def test_bf16_mixed_runs_matmuls_in_bf16_inside_its_context_only():
    precision = Precision("bf16-mixed", "cpu")
    layer = nn.Linear(4, 4)
    with precision.autocast():
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16
    assert layer(torch.randn(2, 4)).dtype == torch.float32
    assert precision.scaler is None


def test_fp16_scales_the_loss_and_unscales_before_clipping_and_the_step():
    """Scaling by a power of two and back is exact: the step equals the plain fp32 step bitwise."""
    model, loss = model_and_loss()
    plain, plain_loss = model_and_loss()
    precision = Precision("fp16-mixed", "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    precision.backward(loss)
    scale = precision.scaler.get_scale()
    first = next(model.parameters())
    plain_loss.backward()
    assert torch.equal(first.grad, scale * next(plain.parameters()).grad)  # scaled in backward
    seen = []

    def clip(opt: torch.optim.Optimizer) -> None:  # the clip must see the true gradients
        seen.append(next(iter(opt.param_groups[0]["params"])).grad.clone())

    precision.step(optimizer, clip=clip)
    plain_optimizer.step()
    assert torch.equal(seen[0], next(plain.parameters()).grad)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert precision.skipped_steps == 0


def test_fp16_overflow_is_skipped_counted_and_its_state_carries_over():
    model, loss = model_and_loss()
    precision = Precision("fp16-mixed", "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = copy.deepcopy(model.state_dict())
    precision.backward(loss)
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    scale = precision.scaler.get_scale()
    precision.step(optimizer, clip=None)
    assert precision.skipped_steps == 1 and precision.scaler.get_scale() == scale / 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    resumed = Precision("fp16-mixed", "cpu")
    resumed.load_state_dict(precision.state_dict())
    assert resumed.scaler.get_scale() == scale / 2 and resumed.skipped_steps == 1
    Precision("fp32", "cpu").load_state_dict(precision.state_dict())  # nothing to take: accepted


@pytest.mark.parametrize("name", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_every_precision_trains(name):
    model, _ = model_and_loss()
    precision = Precision(name, "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    start = copy.deepcopy(model.state_dict())
    for _ in range(3):
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(torch.randn(5, 6)), torch.tensor([0, 1, 2, 0, 1]))
        precision.backward(loss)
        precision.step(optimizer, clip=None)
        optimizer.zero_grad(set_to_none=True)
    assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())
