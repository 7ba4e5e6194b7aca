"""The loss a bench row shows is its whole batch's, micro-batches or not, so the rows' losses compare."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from redline.bench import benchmark
from redline.bench.loops import naive_runner, runtime_runner
from redline.bench.matrix import Setting
from redline.runtime.options import RuntimeOptions
from redline.runtime.runtime import Runtime
from redline.task import Task


def mlp_task() -> Task:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    return Task(
        model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)),
        loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y), batch_size=32, name="mlp",
    )  # fmt: skip


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_row_with_micro_batches_shows_the_loss_of_its_whole_batch():
    # A tuned Plan with 2 micro-batches a step showed the loss of its last micro-batch, half the batch the
    # other rows' losses are of: the auto row's loss told apart from the others' for no reason of its own.
    task = mlp_task()
    setting = Setting("explicit", "cpu", "fp32", False, 32)
    whole = naive_runner(task, setting, seed=0)
    options = RuntimeOptions(devices="cpu", precision="fp32", compile="off", grad_accum=2)
    halves = runtime_runner(task, setting, seed=0, planned_steps=None, options=options)
    assert halves.micro_steps == 2
    first = [whole.run(1), halves.run(1)]  # the same model, the same 32 samples: one batch, or two halves of it
    assert first[1] == pytest.approx(first[0], rel=1e-5)
    assert halves.first_loss == pytest.approx(whole.first_loss, rel=1e-5)
    later = [whole.run(2), halves.run(2)]  # the same updates (the halves' gradients add up to the batch's)
    assert later[1] == pytest.approx(later[0], rel=1e-4)


def test_every_rows_loss_is_of_the_same_step_though_autos_check_warmed_it_up_longer(monkeypatch):
    # On CUDA the auto row's CUDA graphs are checked on its first 35 steps (an automatic compile's too), which its
    # warm-up runs to the end: its loss was taken 30 steps further into training than the other rows', and read
    # 0.086 against their 0.195. Here the check is made to run 30 steps on the CPU.
    calls: dict[int, int] = {}
    real = Runtime.compile_checking

    def checking(self):
        if self.options.cuda_graphs != "auto":  # the auto row's alone, as CUDA graphs are auto's alone
            return real.fget(self)
        calls[id(self)] = calls.get(id(self), 0) + 1
        return calls[id(self)] <= 30

    monkeypatch.setattr(Runtime, "compile_checking", property(checking))
    result = benchmark(
        mlp_task(), devices="cpu", precisions=["fp32"], compiles=[False], steps=4, window=2, planned_steps=10
    )
    naive, eager, auto = result.rows
    assert not any(row.error for row in result.rows)
    # warm-up 2 (auto: 30 more), 2 rounds of a settling step and a window of 2, then the loss's own step
    assert naive.loss_step == eager.loss_step == auto.loss_step == 2 + 30 + 2 * 3 + 1
    assert auto.precision == "fp32" and auto.compile is False  # what the eager row runs: the same losses
    assert auto.loss == pytest.approx(eager.loss, rel=1e-4)
    assert eager.loss == pytest.approx(naive.loss, rel=1e-3)
