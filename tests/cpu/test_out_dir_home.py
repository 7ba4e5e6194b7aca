"""A "~" the shell did not expand (quoted, or --out=~/x) names the home directory, not a directory named "~"."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.train.config import TrainerConfig
from redline.train.trainer import Trainer


def test_out_dir_and_resume_expand_the_home_directory(tmp_path, monkeypatch):
    """Before, Trainer(out_dir="~/runs/x") wrote the run under ./~/runs/x."""
    home, here = tmp_path / "home", tmp_path / "here"
    here.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    config = TrainerConfig(out_dir="~/runs/x", resume="~/runs/x/checkpoints/step-00000002")  # type: ignore[arg-type]
    assert config.out_dir == home / "runs" / "x"
    assert config.resume == str(home / "runs" / "x" / "checkpoints" / "step-00000002")
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    task = redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8)  # fmt: skip
    summary = Trainer(task, runtime=redline.RuntimeOptions(devices="cpu"), out_dir="~/runs/x", max_steps=2,
                      progress=False).fit()  # fmt: skip
    assert summary.steps == 2 and (home / "runs" / "x" / "summary.json").is_file()
    assert list(here.iterdir()) == []  # no directory named "~"
    assert TrainerConfig(resume="auto", out_dir="~").resume == "auto"  # type: ignore[arg-type]


def test_an_out_dir_that_is_a_checkpoint_is_refused_and_the_checkpoint_kept(tmp_path):
    """--out given where --resume was meant wrote the new run's weights into the checkpoint, which the next resume then
    skipped as corrupt."""
    import hashlib

    import pytest

    from redline.errors import ConfigError

    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    task = redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8)  # fmt: skip
    Trainer(task, out_dir=tmp_path / "run", max_steps=2, checkpoint_every=2, progress=False).fit()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    before = hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()
    with pytest.raises(ConfigError, match=r"this one is a checkpoint \(it holds manifest\.json\)") as refused:
        Trainer(task, out_dir=checkpoint, max_steps=2, progress=False, resume="auto")
    assert str(refused.value).endswith(f"hint: to go on from it: --resume {checkpoint} --out {tmp_path / 'run'}")
    assert hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest() == before


def test_resuming_into_an_out_dir_of_another_runs_logs_is_refused_not_logged_as_one_run(tmp_path):
    """A run killed before its first checkpoint left metrics.csv; another run's checkpoint resumed there appended its
    steps 11-12 after the killed run's 1-10, in one file."""
    import pytest

    from redline.errors import ConfigError

    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    task = redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8)  # fmt: skip
    Trainer(task, out_dir=tmp_path / "B", max_steps=2, checkpoint_every=2, progress=False).fit()
    killed = tmp_path / "K"
    killed.mkdir()
    (killed / "metrics.csv").write_text("step,loss\n1,2.29\n")  # a run killed before its first checkpoint
    (killed / ".lock").write_text("")  # which every run leaves
    checkpoint = tmp_path / "B" / "checkpoints" / "step-00000002"
    with pytest.raises(ConfigError, match=r"holds another run's logs \(metrics\.csv\) and no checkpoint"):
        Trainer(task, out_dir=killed, max_steps=4, progress=False, resume=str(checkpoint)).fit()
    assert (killed / "metrics.csv").read_text() == "step,loss\n1,2.29\n"
    resumed = Trainer(task, out_dir=tmp_path / "fresh", max_steps=4, progress=False, resume=str(checkpoint)).fit()
    assert resumed.steps == 4, "into an out_dir of its own, the resume goes on"
