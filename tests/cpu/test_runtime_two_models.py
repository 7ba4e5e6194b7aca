"""Two models and two optimizers in one Runtime (a GAN): the steps equal the plain loop's."""

import pytest
import torch
from torch import nn

import redline
from redline.runtime.cycle import Cycle

bce = nn.functional.binary_cross_entropy_with_logits


def generator_and_discriminator() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return (
        nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2)),
        nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1)),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 2, generator=generator) + 3, torch.randn(16, 2, generator=generator)


def discriminator_loss(disc: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    return bce(disc(real), torch.ones(16, 1)) + bce(disc(fake.detach()), torch.zeros(16, 1))


def test_a_gan_trains_as_the_plain_loop_that_zeroes_each_optimizer_before_its_backward():
    """The generator's loss back-propagates through the discriminator after the discriminator stepped: those
    gradients are not the discriminator's to step on next time (the plain loop's opt_d.zero_grad() drops them)."""
    gen, disc = generator_and_discriminator()
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    for step in range(3):
        real, noise = batch(step)
        fake = gen(noise)
        opt_d.zero_grad()
        discriminator_loss(disc, real, fake).backward()
        opt_d.step()
        opt_g.zero_grad()
        bce(disc(fake), torch.ones(16, 1)).backward()
        opt_g.step()
    rt = redline.Runtime(devices="cpu", compile="off")
    rt_gen, rt_disc = generator_and_discriminator()
    rt_gen, rt_opt_g = rt.setup(rt_gen, lambda params: torch.optim.SGD(params, lr=0.1))
    rt_disc, rt_opt_d = rt.setup(rt_disc, lambda params: torch.optim.SGD(params, lr=0.1))
    for step in range(3):
        real, noise = batch(step)
        fake = rt_gen(noise)
        rt.backward(discriminator_loss(rt_disc, real, fake))
        assert rt.step(rt_opt_d)
        rt.backward(bce(rt_disc(fake), torch.ones(16, 1)))
        assert rt.step(rt_opt_g)
    for mine, plain in [(rt_gen, gen), (rt_disc, disc)]:
        for a, b in zip(mine.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a, b)


def two_in_one_cycle(accum: int, *, zero_after_step: bool):
    """Two models, each with its SGD, both adopted by one accumulation Cycle of ``accum`` batches."""
    first, second = nn.Linear(2, 1), nn.Linear(2, 1)
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_second = torch.optim.SGD(second.parameters(), lr=0.1)
    cycle = Cycle(accum, zero_after_step=zero_after_step)
    cycle.adopt(opt_first)
    cycle.adopt(opt_second)
    return first, second, opt_first, opt_second, cycle


@pytest.mark.parametrize("zero_after_step", [True, False])  # CUDA's order, and every other device's
def test_the_first_backward_after_a_step_starts_without_any_gradient(zero_after_step):
    first, second, opt_first, opt_second, cycle = two_in_one_cycle(1, zero_after_step=zero_after_step)
    cycle.next_batch()
    first(torch.ones(1, 2)).sum().backward()
    assert cycle.due(opt_first)
    cycle.stepped(opt_first)
    cycle.next_batch()  # a second loss reaches both models after the first one stepped
    (first(torch.ones(1, 2)) + second(torch.ones(1, 2))).sum().backward()
    assert cycle.due(opt_second)
    cycle.stepped(opt_second)
    assert first.weight.grad is not None  # until the next backward: a step frees only its own
    cycle.next_batch()
    assert first.weight.grad is None and second.weight.grad is None


def test_backwards_before_a_step_still_accumulate():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cycle = Cycle(1, zero_after_step=False)
    cycle.adopt(optimizer)
    cycle.next_batch()
    model(torch.ones(1, 2)).sum().backward()
    cycle.next_batch()  # no step between: the second loss adds to the first (retain_graph, two losses)
    model(torch.ones(1, 2)).sum().backward()
    assert torch.equal(model.weight.grad, torch.full((1, 2), 2.0))


def test_an_optimizer_amid_its_accumulation_keeps_its_gradients_when_another_steps():
    first, second, opt_first, opt_second, cycle = two_in_one_cycle(2, zero_after_step=False)
    for model, optimizer, due in [(first, opt_first, False), (second, opt_second, False), (first, opt_first, True)]:
        cycle.next_batch()
        model(torch.ones(1, 2)).sum().backward()
        assert cycle.due(optimizer) is due
        if due:
            cycle.stepped(optimizer)
    cycle.next_batch()  # the second model's other half of its cycle, after the first one stepped
    second(torch.ones(1, 2)).sum().backward()
    assert cycle.due(opt_second)
    assert torch.equal(second.weight.grad, torch.full((1, 2), 2.0))  # both halves: none dropped by the other's step


def test_one_model_set_up_twice_with_two_optimizers_refuses_the_first_before_its_state_is_lost(tmp_path):
    # both steps were taken, the checkpoint kept the second optimizer's state alone (the first's momentum lost
    # without a word), and it counted 8 steps for 4 batches
    with redline.Runtime(devices="cpu", precision="fp32", compile="off") as rt:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        weights = [p for p in model.parameters() if p.dim() == 2]
        model, first = rt.setup(model, torch.optim.SGD(weights, lr=0.1, momentum=0.9))
        biases = [p for p in model.parameters() if p.dim() == 1]
        model, second = rt.setup(model, torch.optim.Adam(biases, lr=1e-2))
        for _ in range(2):
            rt.backward(model(torch.randn(5, 8)).square().mean())
            replaced = r"(?s)rt.step\(\) got an optimizer \(SGD\) that a later rt.setup\(\) of its model replaced with"
            with pytest.raises(redline.ConfigError, match=replaced + r" another \(Adam\).*parameter groups"):
                rt.step(first)
            with pytest.raises(redline.ConfigError, match=r"rt.clip_grad_norm_\(\) got an optimizer \(SGD\) that a"):
                rt.clip_grad_norm_(first, 1.0)
            assert rt.step(second)
        assert not first.state and rt.save(tmp_path / "ck").step == 2  # a step per batch
