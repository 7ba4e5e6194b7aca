"""The Strategy objects on their own: wrap, gradient sync, the user's module, state, checkpoints, weights.

DDP and FSDP run here on a one-rank gloo group inside the test process, but for FSDP's load of a whole checkpoint,
which runs this file as two ranks; tests/cpu/test_dist.py and test_fsdp.py run them on two processes.
"""

import datetime
import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from redline.checkpoint import read_checkpoint, verify
from redline.checkpoint import whole as whole_format
from redline.errors import ConfigError, TrainingError
from redline.runtime.contract import user_code
from redline.runtime.runtime import Runtime
from redline.runtime.strategy import Strategy, build_strategy
from redline.runtime.strategy.single import SingleDevice

CPU = torch.device("cpu")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, steps: int = 2) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        inputs, targets = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        with strategy.gradient_sync(model, True):
            nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def test_single_device_saves_and_loads_a_whole_checkpoint(tmp_path):
    strategy = SingleDevice()
    model, optimizer = strategy.wrap(make_model(), adamw, device=CPU, precision="fp32")
    train_steps(model, optimizer, strategy)
    written = strategy.save(
        tmp_path / "step-00000002", model, optimizer, runtime_state={"rng": []}, extra={"epoch": 3}, plan={},
        step=2,
    )  # fmt: skip
    assert written.step == 2 and written.format == "redline-whole-2" and not written.sharded
    verify(read_checkpoint(written.path))
    fresh, fresh_optimizer = strategy.wrap(other_model(), adamw, device=CPU, precision="fp32")
    runtime_state, extra = strategy.load(written, fresh, fresh_optimizer)
    assert extra == {"epoch": 3} and runtime_state == {"rng": []}
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    train_steps(model, optimizer, strategy, 1)
    train_steps(fresh, fresh_optimizer, strategy, 1)  # the optimizer's moments came back too
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))


def other_model() -> nn.Module:
    """The same architecture with other weights: what a load must overwrite."""
    model = make_model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    return model


def test_single_device_state_dict_round_trips_and_weights_load_into_the_plain_model(tmp_path):
    strategy = SingleDevice()
    model, optimizer = strategy.wrap(make_model(), adamw, device=CPU, precision="fp32")
    train_steps(model, optimizer, strategy)
    state = strategy.state_dict(model, optimizer)
    other, other_optimizer = strategy.wrap(make_model(), adamw, device=CPU, precision="fp32")
    strategy.load_state_dict(other, other_optimizer, state)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters(), strict=True))
    strategy.save_weights(tmp_path / "model.safetensors", model)
    assert set(load_file(tmp_path / "model.safetensors")) == set(make_model().state_dict())


@pytest.mark.usefixtures("one_rank_group")
def test_ddp_wraps_unwraps_and_skips_the_gradient_sync_mid_accumulation(tmp_path):
    strategy = build_strategy("ddp")
    model, optimizer = strategy.wrap(make_model(), adamw, device=CPU, precision="fp32")
    assert isinstance(model, DistributedDataParallel) and strategy.module(model) is model.module
    with strategy.gradient_sync(model, False):
        assert model.require_backward_grad_sync is False
    assert model.require_backward_grad_sync is True
    train_steps(model, optimizer, strategy)
    written = strategy.save(tmp_path / "ckpt", model, optimizer, runtime_state={}, extra={}, plan={}, step=None)
    assert written.format == "redline-whole-2" and written.step == 0
    assert not any(name.startswith("module.") for name in load_file(written.path / "model.safetensors"))


@pytest.mark.usefixtures("one_rank_group")
def test_fsdp_shards_rebuilds_the_optimizer_and_writes_shards_that_a_plain_model_loads(tmp_path):
    strategy = build_strategy("fsdp")
    given = make_model()
    model, optimizer = strategy.wrap(given, adamw, device=CPU, precision="fp32")
    assert model is given and all(isinstance(p, DTensor) for p in model.parameters())
    assert all(isinstance(p, DTensor) for p in optimizer.param_groups[0]["params"])
    train_steps(model, optimizer, strategy)
    written = strategy.save(tmp_path / "ckpt", model, optimizer, runtime_state={"x": 1}, extra={"y": 2}, plan={},
                            step=2)  # fmt: skip
    assert written.sharded and written.manifest["world_size"] == 1
    assert all("sha256" in entry for entry in written.manifest["files"].values())
    expected = plain_state(model)
    strategy.save_weights(tmp_path / "model.safetensors", model)
    on_disk = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(on_disk[k], v) for k, v in expected.items())
    plain = SingleDevice()
    fresh, fresh_optimizer = plain.wrap(make_model(), adamw, device=CPU, precision="fp32")
    assert plain.load(written, fresh, fresh_optimizer) == ({"x": 1}, {"y": 2})
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


class Nesterov(torch.optim.SGD):
    """Takes an argument that its ``defaults`` do not keep, as many custom optimizers do."""

    def __init__(self, params, lr: float, scale: float) -> None:
        super().__init__(params, lr=lr * scale, momentum=0.9, nesterov=True)


@pytest.mark.usefixtures("one_rank_group")
def test_fsdp_builds_a_factory_s_optimizer_on_the_shards_and_keeps_an_instance_s_hooks():
    steps: list[str] = []

    def factory(params):
        optimizer = Nesterov(params, lr=1e-2, scale=0.5)
        optimizer.register_step_post_hook(lambda *_: steps.append("factory"))  # e.g. an EMA update
        return optimizer

    model, optimizer = build_strategy("fsdp").wrap(make_model(), factory, device=CPU, precision="fp32")
    assert isinstance(optimizer, Nesterov) and optimizer.param_groups[0]["lr"] == 5e-3
    assert all(isinstance(p, DTensor) for p in optimizer.param_groups[0]["params"])
    train_steps(model, optimizer, build_strategy("fsdp"))
    assert steps == ["factory"] * 2
    given = make_model()
    instance = torch.optim.AdamW(given.parameters(), lr=1e-2)
    instance.register_step_post_hook(lambda *_: steps.append("instance"))
    model, optimizer = build_strategy("fsdp").wrap(given, instance, device=CPU, precision="fp32")
    train_steps(model, optimizer, build_strategy("fsdp"), 1)
    assert steps[2:] == ["instance"]


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("requested", ["auto", "on"])
def test_a_runtime_under_fsdp_trains_a_convolutional_model_nchw_where_nhwc_would_stop_its_setup(requested, monkeypatch):
    monkeypatch.setenv("REDLINE_CPU", "amx")  # where auto lays bf16 convolutions out NHWC
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    with Runtime(devices="cpu", strategy="fsdp", precision="bf16-mixed", compile="off", channels_last=requested) as rt:
        model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for _ in range(2):
            rt.backward(model(rt.to_device(torch.randn(4, 3, 4, 4))).float().square().mean())
            rt.step(optimizer)
        layout = rt.explain().channels_last
    assert all(p.full_tensor().is_contiguous() for p in model.parameters())
    assert layout.value is False and "FSDP shards contiguous parameters only" in layout.reason


def load_whole_on_one_of_two_ranks(rank: int, out: Path) -> None:
    """One rank of a two-rank FSDP job loading OUT/whole: publish which checkpoint files this rank read, the loaded
    weights and states, and the weights after one more step (the Adam moments loaded too)."""
    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    reads: list[str] = []
    for name in ("read_weights", "read_optimizer"):
        original = getattr(whole_format, name)
        setattr(whole_format, name, lambda *args, _name=name, _read=original: (reads.append(_name), _read(*args))[1])
    try:
        fsdp = build_strategy("fsdp")
        sharded, optimizer = fsdp.wrap(make_model(), adamw, device=CPU, precision="fp32")
        states = fsdp.load(read_checkpoint(out / "whole"), sharded, optimizer)
        loaded = plain_state(sharded)
        train_steps(sharded, optimizer, fsdp, 1)
        result = {"reads": reads, "states": states, "loaded": loaded, "stepped": plain_state(sharded)}
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        gc.collect()  # FSDP modules sit in reference cycles; free them while gloo still runs
        dist.destroy_process_group()


def test_fsdp_loads_a_whole_checkpoint_read_once_on_rank_0(tmp_path):
    single = SingleDevice()
    model, optimizer = single.wrap(make_model(), adamw, device=CPU, precision="fp32")
    train_steps(model, optimizer, single)
    single.save(tmp_path / "whole", model, optimizer, runtime_state={}, extra={"z": 3}, plan={}, step=2)
    saved = plain_state(model)
    train_steps(model, optimizer, single, 1)
    ranks = [subprocess.Popen([sys.executable, __file__, str(rank), str(tmp_path)]) for rank in range(2)]
    try:
        codes = [p.wait(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert codes == [0, 0]
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["reads"] == (["read_weights", "read_optimizer"] if rank == 0 else []), rank
        assert result["states"] == ({}, {"z": 3})
        assert all(torch.equal(result["loaded"][k], v) for k, v in saved.items())
        stepped = result["stepped"]  # the same batch on both ranks: the step of one process
        assert all(torch.allclose(stepped[k], v, atol=1e-6) for k, v in model.state_dict().items())


@pytest.mark.usefixtures("one_rank_group")
def test_fsdp_resumes_a_whole_checkpoint_written_before_the_first_step_as_the_unbroken_run(tmp_path):
    single = SingleDevice()
    model, optimizer = single.wrap(make_model(), adamw, device=CPU, precision="fp32")
    written = single.save(tmp_path / "whole", model, optimizer, runtime_state={}, extra={}, plan={}, step=0)
    train_steps(model, optimizer, single)
    fsdp = build_strategy("fsdp")
    sharded, sharded_optimizer = fsdp.wrap(make_model(), adamw, device=CPU, precision="fp32")
    fsdp.load(written, sharded, sharded_optimizer)
    assert not sharded_optimizer.state  # no placeholder step from loading: Adam's first step is its first
    train_steps(sharded, sharded_optimizer, fsdp)
    assert all(torch.allclose(plain_state(sharded)[k], v, atol=1e-6) for k, v in model.state_dict().items())


@pytest.mark.usefixtures("one_rank_group")
def test_fsdp_accumulates_unreduced_gradients_until_the_last_micro_batch():
    strategy = build_strategy("fsdp")
    gen = torch.Generator().manual_seed(5)
    halves = [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(2)]
    accumulated, _ = strategy.wrap(make_model(), adamw, device=CPU, precision="fp32")
    with strategy.gradient_sync(accumulated, False):
        nn.functional.cross_entropy(accumulated(halves[0][0]), halves[0][1]).backward()
    assert all(p.grad is None for p in accumulated.parameters()), "reduced before the last micro-batch"
    with strategy.gradient_sync(accumulated, True):
        nn.functional.cross_entropy(accumulated(halves[1][0]), halves[1][1]).backward()
    whole, _ = strategy.wrap(make_model(), adamw, device=CPU, precision="fp32")
    for inputs, targets in halves:  # the same two backwards, each reduced at once
        nn.functional.cross_entropy(whole(inputs), targets).backward()
    for a, b in zip(accumulated.parameters(), whole.parameters(), strict=True):
        assert torch.allclose(a.grad.full_tensor(), b.grad.full_tensor(), atol=1e-6)


class WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.head = nn.Linear(3, 3)  # built, never used by forward

    def forward(self, x):
        return self.body(x)


@pytest.mark.usefixtures("one_rank_group")
def test_ddp_names_the_parameters_the_loss_left_without_a_gradient_after_the_first_step():
    """DDP's reducer failed at step 2 with "Expected to have finished reduction", naming no parameter."""
    strategy = build_strategy("ddp")
    model, optimizer = strategy.wrap(WithUnusedHead(), adamw, device=CPU, precision="fp32")
    message = r"(?s)2 got none in the first step: head\.weight, head\.bias\nhint: freeze what the loss does not use"
    with pytest.raises(ConfigError, match=message):
        train_steps(model, optimizer, strategy)
    frozen = WithUnusedHead()
    frozen.head.requires_grad_(False)  # the fix the hint names
    strategy = build_strategy("ddp")
    model, optimizer = strategy.wrap(frozen, adamw, device=CPU, precision="fp32")
    train_steps(model, optimizer, strategy, steps=3)


class HeadOnOddSteps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.head = nn.Linear(3, 3)  # used by the first forward, the third, ...: not by the second
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        return self.head(self.body(x)) if self.forwards % 2 else self.body(x)


@pytest.mark.usefixtures("one_rank_group")
def test_ddp_s_refusal_of_the_step_after_one_that_left_a_parameter_unused_names_the_fix():
    """A head unused from step 2 on (the first step's check passed) gave torch's "Expected to have finished reduction
    in the prior iteration" at step 3, hinting at the dataset's items."""
    strategy = build_strategy("ddp")
    model, optimizer = strategy.wrap(HeadOnOddSteps(), adamw, device=CPU, precision="fp32")
    train_steps(model, optimizer, strategy)  # the first step used the head, the second did not
    inputs, targets = torch.zeros(8, 6), torch.zeros(8, dtype=torch.long)
    with pytest.raises(TrainingError) as refused, user_code("step 3", inputs, targets):
        model(inputs)
    message = str(refused.value)
    assert message.startswith(
        "step 3: under DDP every parameter that requires a gradient must get one from the loss, and the step before "
        "left some without one (DDP numbers them 6 7, counting from 0 those that require one)"
    )
    assert "--find-unused-parameters (find_unused_parameters=True)" in message and "dataset's items" not in message


if __name__ == "__main__":
    load_whole_on_one_of_two_ranks(int(sys.argv[1]), Path(sys.argv[2]))
