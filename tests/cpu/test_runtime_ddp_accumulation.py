"""Gradient accumulation under DDP in the user's own loop: only the backward that ends a cycle all-reduces.

DDP decides whether a backward all-reduces in the forward before it, which the user's loop runs outside
``rt.backward``. A one-rank gloo group inside the test process counts the all-reduces through a comm hook;
two processes (this file run as a script) train to the weights of one.
"""

import gc
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.distributed as dist
from torch import nn

import redline
from redline.runtime.strategy import Strategy


def counted(model: nn.Module) -> list[int]:
    """Count ``model``'s all-reduces (one per gradient bucket), passing each bucket on as DDP's own hook would."""
    calls: list[int] = []

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(1)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())  # one rank: the average is the rank's own gradient
        return done

    model.register_comm_hook(None, hook)  # type: ignore[operator]
    return calls


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(step))


@pytest.mark.usefixtures("one_rank_group")
def test_backward_mid_accumulation_does_not_all_reduce_and_the_step_equals_the_plain_loop():
    torch.manual_seed(0)
    plain = nn.Linear(3, 2)
    rt = redline.Runtime(devices="cpu", strategy="ddp", grad_accum=4, compile="off")
    torch.manual_seed(0)
    model, optimizer = rt.setup(nn.Linear(3, 2), lambda params: torch.optim.SGD(params, lr=0.1))
    calls = counted(model)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(8):
        (plain(batch(step)).pow(2).mean() / 4).backward()
        if step % 4 == 3:
            plain_optimizer.step()
            plain_optimizer.zero_grad()
        rt.backward(model(batch(step)).pow(2).mean())
        assert len(calls) == (step + 1) // 4  # the cycle's last backward alone communicates
        assert rt.step(optimizer) == (step % 4 == 3)
    for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-7)


@pytest.mark.usefixtures("one_rank_group")
def test_each_of_two_models_all_reduces_in_the_last_backward_of_its_own_cycle():
    """A GAN's discriminator steps on the backward of its own loss: a count of the batches of both models put
    that backward mid-cycle (an odd count), so its gradients were never reduced over the ranks before its step."""
    torch.manual_seed(0)
    rt = redline.Runtime(devices="cpu", strategy="ddp", grad_accum=2, compile="off")
    gen, opt_g = rt.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))
    disc, opt_d = rt.setup(nn.Linear(2, 1), lambda params: torch.optim.SGD(params, lr=0.1))
    calls_g, calls_d = counted(gen), counted(disc)
    for step in range(4):
        fake = gen(batch(step)[:, :2])
        before = len(calls_d)
        rt.backward(disc(fake.detach()).mean() - disc(batch(step + 9)[:, :2]).mean())
        if step % 2 == 1:  # the discriminator's step is due: its gradients were reduced in this backward
            assert len(calls_d) > before
        assert rt.step(opt_d) == (step % 2 == 1)
        before = len(calls_g)
        rt.backward(-disc(fake).mean())
        if step % 2 == 1:
            assert len(calls_g) > before
        assert rt.step(opt_g) == (step % 2 == 1)
    assert len(calls_g) == 2  # once a cycle: the generator's loss is its only one


@pytest.mark.usefixtures("one_rank_group")
def test_a_loss_of_one_model_is_no_unused_parameter_of_another_but_a_parameter_it_leaves_out_is():
    """Two models trained in turn: the first loss reaches the first model alone, which says nothing of the second's
    parameters; the second's own loss that leaves one of its layers out is still refused."""
    from redline.errors import ConfigError

    rt = redline.Runtime(devices="cpu", strategy="ddp", compile="off")
    first, opt_first = rt.setup(nn.Linear(3, 1), lambda params: torch.optim.SGD(params, lr=0.1))
    second, _ = rt.setup(OneBranch(), lambda params: torch.optim.SGD(params, lr=0.1))
    rt.backward(first(batch(0)).mean())
    assert rt.step(opt_first)
    with pytest.raises(ConfigError, match="got none in the first step"):
        rt.backward(second(batch(1)).mean())


class OneBranch(nn.Module):
    """A model whose forward leaves one of its layers out."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(3, 1), nn.Linear(3, 1)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.used(rows)


@pytest.mark.usefixtures("one_rank_group")
def test_unwrap_gives_each_of_two_models_under_its_own_names_for_the_user_to_save():
    """rt.module and rt.save serve one model; a GAN's two, saved by the user, would carry DDP's `module.` prefix (and
    torch.compile's `_orig_mod.`), which loads into no plain model."""
    from redline.errors import ConfigError

    rt = redline.Runtime(devices="cpu", strategy="ddp", compile="off")
    gen, _ = rt.setup(torch.compile(nn.Linear(2, 2)), lambda params: torch.optim.SGD(params, lr=0.1))
    disc, _ = rt.setup(nn.Linear(2, 1), lambda params: torch.optim.SGD(params, lr=0.1))
    assert set(gen.state_dict()) == {"module._orig_mod.weight", "module._orig_mod.bias"}  # what a user saved before
    for model in (gen, disc):
        plain = rt.unwrap(model)
        assert set(plain.state_dict()) == {"weight", "bias"}
        assert rt.unwrap(plain) is plain  # the user's own module, given back as it is
    with pytest.raises(ConfigError, match=r"a model that rt\.setup\(\) returned"):
        rt.unwrap(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"rt\.unwrap\(model\)\.state_dict\(\)"):  # the way out it names
        rt.state_dict()


@pytest.mark.usefixtures("one_rank_group")
def test_a_backward_in_the_callers_own_no_sync_stays_local(monkeypatch):
    """The batch-size search steps with the gradients kept local (a rank out of memory must leave no other waiting in
    a collective): the cycle's last backward, inside its no_sync(), must not average them after all."""
    from redline.runtime.strategy.ddp import DDP

    averaged: list[int] = []
    monkeypatch.setattr(DDP, "average_gradients", lambda self, model: averaged.append(1))
    rt = redline.Runtime(devices="cpu", strategy="ddp", compile="off")
    model, optimizer = rt.setup(nn.Linear(3, 1), lambda params: torch.optim.SGD(params, lr=0.1))
    calls = counted(model)
    for step in range(2):
        with cast(Strategy, rt.strategy).gradient_sync(model, False):
            rt.backward(model(batch(step)).mean())
        assert rt.step(optimizer)
    assert calls == [] and averaged == []
    rt.backward(model(batch(3)).mean())  # outside it, as before: reduced in the backward
    assert len(calls) == 1 and averaged == []


def gan_loop(rt: redline.Runtime, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """Train a tiny GAN with grad_accum=2 in the user's own loop, each rank on its share of every global batch."""
    torch.manual_seed(0)
    gen, opt_g = rt.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))
    disc, opt_d = rt.setup(nn.Linear(2, 1), lambda params: torch.optim.SGD(params, lr=0.1))
    share = slice(rank * 8 // world, (rank + 1) * 8 // world)
    for step in range(6):
        noise = torch.randn(8, 2, generator=torch.Generator().manual_seed(step))[share]
        real = torch.randn(8, 2, generator=torch.Generator().manual_seed(step + 99))[share] + 2
        fake = gen(noise)
        rt.backward(disc(fake.detach()).pow(2).mean() + (disc(real) - 1).pow(2).mean())
        rt.step(opt_d)
        rt.backward((disc(fake) - 1).pow(2).mean())
        rt.step(opt_g)
    return {f"{name}.{key}": value.detach().clone() for name, model in (("gen", gen), ("disc", disc))
            for key, value in rt.strategy.module(model).state_dict().items()}  # fmt: skip


def test_two_processes_train_a_gan_with_accumulation_to_the_weights_of_one(tmp_path: Path):
    store = tmp_path / "store"
    procs = [
        subprocess.Popen([sys.executable, __file__, str(rank), str(tmp_path), str(store)], stderr=subprocess.PIPE)
        for rank in range(2)
    ]
    try:
        errors = [proc.communicate(timeout=240)[1].decode()[-3000:] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(errors)
    one = gan_loop(redline.Runtime(devices="cpu", grad_accum=2, compile="off"))
    for rank in range(2):
        two = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        for key, value in one.items():  # DDP averages the halves where one process takes the whole: 1e-7 apart
            assert torch.allclose(two[key], value, rtol=0, atol=1e-6), key


if __name__ == "__main__":
    rank, out, store = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        with redline.Runtime(devices="cpu", strategy="ddp", grad_accum=2, compile="off") as rt:
            torch.save(gan_loop(rt, rank, 2), out / f"rank-{rank}.pt")
    finally:
        gc.collect()  # the DDP-wrapped models sit in reference cycles; free them while gloo still runs
        dist.destroy_process_group()
