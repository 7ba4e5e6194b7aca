"""A trial's memory: one candidate's copy holds training state at a time, and what ran out of memory is not cached."""

from __future__ import annotations

import weakref
from typing import ClassVar

import torch
from torch import nn

from redline.parallel.env import DistEnv
from redline.runtime.measure import measure_auto
from redline.runtime.options import RuntimeOptions
from redline.runtime.trial import run_trial
from redline.runtime.trial_copy import room_beside
from redline.task import Task

OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 67108864 bytes"  # as c10 says it


class RoomForOne(nn.Module):
    """A small model on a device with room for one training run: its forward runs out of memory (as the CPU
    allocator says it) while another copy of it holds gradients, or an optimizer of one holds state."""

    copies: ClassVar[weakref.WeakSet[nn.Module]] = weakref.WeakSet()
    optimizers: ClassVar[weakref.WeakSet[torch.optim.Optimizer]] = weakref.WeakSet()

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RoomForOne.copies.add(self)  # a deep copy runs no __init__
        mine = set(self.parameters())
        others_grads = any(p.grad is not None for m in RoomForOne.copies if m is not self for p in m.parameters())
        others_state = any(o.state and not set(o.state) <= mine for o in RoomForOne.optimizers)
        if others_grads or others_state:
            raise RuntimeError(OUT_OF_MEMORY)
        return self.linear(x)

    @staticmethod
    def optimizer(params) -> torch.optim.Optimizer:
        built = torch.optim.AdamW(params, lr=1e-3)
        RoomForOne.optimizers.add(built)
        return built


class ShortUnderAutocast(nn.Module):
    """A small model whose forward under autocast runs out of memory from its ``first_failing``-th call on."""

    calls: ClassVar[int] = 0
    first_failing: ClassVar[int] = 1

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            ShortUnderAutocast.calls += 1
            if ShortUnderAutocast.calls >= ShortUnderAutocast.first_failing:
                raise RuntimeError(OUT_OF_MEMORY)
        return self.linear(x)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)


def task(model: type[nn.Module], **changes: object) -> Task:
    inputs, targets = batch()
    data = torch.utils.data.TensorDataset(inputs.repeat(4, 1), targets.repeat(4, 1))
    return Task(model=model, loss_fn=nn.functional.mse_loss, train_data=data, batch_size=16, **changes)


def test_a_trial_holds_one_copys_gradients_and_optimizer_state_at_a_time():
    """Every copy held its AdamW state and gradients at once: on a device near its memory bf16 was rejected
    'it failed: ... can't allocate memory' though the run itself fit."""
    RoomForOne.copies.clear()
    RoomForOne.optimizers.clear()
    results = run_trial(
        RoomForOne(), RoomForOne.optimizer, nn.functional.mse_loss, batch(), torch.device("cpu"), ["bf16-mixed"],
        stop_early=False,
    )  # fmt: skip
    assert [(m.precision, m.out_of_memory) for m in results] == [("fp32", False), ("bf16-mixed", False)]
    assert "it failed" not in results[1].rejected
    assert all(len(m.step_times) == 12 for m in results)  # both timed in every round, taking turns
    assert not any(o.state for o in RoomForOne.optimizers)  # none left holding state for the run to pay


def test_a_candidate_out_of_memory_at_its_first_step_is_rejected_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("REDLINE_CPU", "amx")
    monkeypatch.setattr(ShortUnderAutocast, "calls", 0)
    cpu = RuntimeOptions(devices="cpu")
    first = measure_auto(task(ShortUnderAutocast), cpu, 16, 5000, DistEnv(), trial="on")["precision"]
    assert first.value == "fp32" and "bf16-mixed rejected: it failed: DefaultCPUAllocator" in first.reason
    assert first.reason.endswith("; not cached: bf16-mixed ran out of memory, which a run with more free may not")
    assert not (tmp_path / "trials").exists()
    again = measure_auto(task(ShortUnderAutocast), cpu, 16, 5000, DistEnv(), trial="auto")["precision"]
    assert "cached from" not in again.reason and "not cached: bf16-mixed ran out of memory" in again.reason


def test_a_candidate_out_of_memory_in_a_later_block_leaves_the_timing_and_the_trial_goes_on(monkeypatch):
    monkeypatch.setattr(ShortUnderAutocast, "calls", 0)
    monkeypatch.setattr(ShortUnderAutocast, "first_failing", 3)  # its first step and its first block's settling
    results = run_trial(
        ShortUnderAutocast(), lambda p: torch.optim.SGD(p, lr=0.01), nn.functional.mse_loss, batch(),
        torch.device("cpu"), ["bf16-mixed"], stop_early=False,
    )  # fmt: skip
    reference, bf16 = results
    assert len(reference.step_times) == 12 and not reference.rejected  # fp32 timed in full, anew
    assert bf16.out_of_memory and bf16.rejected.startswith("it failed: DefaultCPUAllocator: can't allocate memory")


def test_a_parked_copy_keeps_its_weights_on_a_device_with_room_for_the_next_copys_training():
    """Every turn moved a parked copy's weights to the host and back: seconds a trial for a model of a few GB."""
    model = nn.Linear(100, 100)  # 10,100 float32 parameters: 40,400 bytes
    weights = 40_400
    assert room_beside(model, torch.device("cuda"), free=4 * weights)
    assert not room_beside(model, torch.device("cuda"), free=4 * weights - 1)  # short: the weights go to the host
    assert not room_beside(model, torch.device("mps"))  # its free memory unread: moved, as before
