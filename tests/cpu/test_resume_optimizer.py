"""A resumed run steps its optimizer as its checkpoint's run did (fused or as given), whatever a timing says now: the
two round differently, and a busy machine's timing can go either way."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.plan.optimizer import StepTiming
from redline.runtime import fused
from redline.train.trainer import Trainer


def task() -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 8, generator=gen), torch.randint(0, 3, (96,), generator=gen)
    return redline.Task(
        model=lambda: nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)), loss_fn=nn.functional.cross_entropy,
        train_data=TensorDataset(x, y), optimizer=lambda params: torch.optim.AdamW(params, lr=0.05), batch_size=8,
    )  # fmt: skip


def timing(monkeypatch, fused_s: float) -> None:
    """The optimizer timing says fused steps in ``fused_s`` against 1 ms as given."""
    monkeypatch.setattr(fused, "timed_or_cached", lambda optimizer, device: StepTiming(1e-3, fused_s, 10, 10))


def fit(out, **kwargs) -> redline.TrainSummary:
    runtime = redline.RuntimeOptions(devices="cpu", seed=0, precision="fp32", compile="off")
    config = {"checkpoint_every": 3, "log_every": 1, "trial": "off", "out_dir": out, **kwargs}
    with Trainer(task(), runtime=runtime, progress=False, **config) as trainer:
        return trainer.fit()


@pytest.mark.parametrize(("first", "then"), [(0.25e-3, 4e-3), (4e-3, 0.25e-3)])
def test_a_resumed_run_keeps_its_checkpoints_optimizer_implementation(tmp_path, monkeypatch, first, then):
    timing(monkeypatch, first)
    unbroken = fit(tmp_path / "unbroken", max_steps=9)
    fit(tmp_path / "run", max_steps=6)
    timing(monkeypatch, then)  # a timing now says the other implementation
    resumed = fit(tmp_path / "run", max_steps=9, resume="auto")
    assert resumed.plan.optimizer.value == unbroken.plan.optimizer.value == ("fused" if first < 1e-3 else "as given")
    assert resumed.plan.optimizer.reason.startswith("from checkpoint step 6: AdamW")
    a, b = load_file(tmp_path / "unbroken" / "model.safetensors"), load_file(tmp_path / "run" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "bitwise as the unbroken run"


def test_a_checkpoint_of_another_kind_of_device_leaves_the_implementation_to_this_ones_rule(monkeypatch):
    # A CUDA run's fused AdamW (by CUDA's rule) resumed on a CPU read "from checkpoint step 3: AdamW rebuilt fused:
    # one kernel updates every parameter", untimed, where the CPU's timing decides
    from redline.parallel.env import DistEnv
    from redline.train import tuned

    def plan_on(device: str) -> dict:
        return {"device": {"value": device}, "optimizer": {"value": "fused", "reason": "AdamW rebuilt fused"}}

    options = redline.RuntimeOptions(devices="cpu")
    monkeypatch.setattr(tuned, "load_plan", lambda found: plan_on("cuda:0"))
    assert tuned.resumed_choices(object(), None, options, DistEnv()) is None  # type: ignore[arg-type]
    monkeypatch.setattr(tuned, "load_plan", lambda found: plan_on("cpu"))
    kept = tuned.resumed_choices(object(), None, options, DistEnv())  # type: ignore[arg-type]
    assert kept is not None and kept["optimizer"].value == "fused"
