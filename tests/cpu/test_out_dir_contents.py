"""An out_dir holding what the run would write over, or a folder where it writes a file, is refused before training."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.errors import ConfigError
from redline.train.trainer import Trainer


def task() -> redline.Task:
    gen = torch.Generator().manual_seed(0)  # the same data each time: a resumed run is refused other items
    data = TensorDataset(torch.randn(16, 4, generator=gen), torch.randint(0, 2, (16,), generator=gen))
    return redline.Task(
        model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data, val_data=data,
        batch_size=8, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )  # fmt: skip


def trainer(out: Path, **kwargs: object) -> Trainer:
    options = redline.RuntimeOptions(devices="cpu", seed=0)
    return Trainer(task(), runtime=options, progress=False, out_dir=out, **{"max_steps": 2, **kwargs})


def test_a_directory_of_the_users_own_files_with_the_runs_names_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    # They were replaced silently: the weights and summary after training, the logs at the first log.
    for name in ("model.safetensors", "summary.json", "metrics.csv", "eval.jsonl", "notes.txt"):
        (tmp_path / name).write_text("mine")
    with pytest.raises(ConfigError) as refused:
        trainer(tmp_path)
    message = str(refused.value)
    assert "holds model.safetensors, summary.json, metrics.csv, eval.jsonl, not of a redline run" in message
    assert f"hint: pass another --out, or move those files out of {tmp_path}" in message
    assert all(path.read_text() == "mine" for path in tmp_path.iterdir())
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "eval.jsonl", "metrics.csv", "model.safetensors", "notes.txt", "summary.json"
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["metrics.csv", "eval.jsonl", "summary.json", "model.safetensors"])
def test_a_folder_named_as_a_run_file_is_refused_before_training(tmp_path: Path, name: str) -> None:
    # metrics.csv/ was a traceback at the first log; summary.json/ and model.safetensors/ failed after training,
    # with hints to free disk space or to pass a file's path the Trainer does not take.
    trainer(tmp_path).fit()  # a run's directory: its own files are written over, a folder is not
    (tmp_path / name).unlink()
    (tmp_path / name).mkdir()
    with pytest.raises(ConfigError) as refused:
        trainer(tmp_path, resume="auto")
    message = str(refused.value)
    assert f"it holds {name}/, a folder where the run writes a file of that name" in message
    assert f"hint: move {tmp_path / name} out of the way, or pass another --out" in message


def test_an_earlier_runs_directory_is_still_resumed_or_written_over(tmp_path: Path) -> None:
    trainer(tmp_path, checkpoint_every=1).fit()
    assert trainer(tmp_path, resume="auto", max_steps=3).fit().steps == 3  # resumed: its checkpoints/ name it a run
    killed = tmp_path / "killed"  # a run killed before its first checkpoint leaves its logs and its .lock alone
    trainer(killed).fit()
    shutil.rmtree(killed / "checkpoints")
    (killed / "model.safetensors").unlink()
    (killed / "summary.json").unlink()
    logged = (killed / "metrics.csv").read_text()
    with pytest.raises(
        ConfigError, match=r"holds an earlier run's logs \(metrics\.csv, eval\.csv, metrics\.jsonl, eval\.jsonl\) and"
    ):
        trainer(killed).fit()  # a new run there replaced that run's logs with its own
    assert (killed / "metrics.csv").read_text() == logged
    assert trainer(killed, resume="auto").fit().steps == 2  # --resume auto finds no checkpoint: it starts over


def test_train_with_nproc_refuses_the_users_files_before_any_worker_starts(tmp_path, monkeypatch) -> None:
    # Each worker refused them, and each --max-restarts attempt again ("failed in all 3 attempts").
    import torch.distributed.run
    from typer.testing import CliRunner

    from redline.cli.main import app

    def never_start(args: object) -> None:
        raise AssertionError("workers started where the launcher should have refused")

    monkeypatch.setattr(torch.distributed.run, "run", never_start)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.json").write_text("notes")
    args = ["train", "--task", "example:digits", "--out", str(out), "--nproc", "2", "--max-restarts", "2"]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, ConfigError), result.output
    assert f"--out='{out}' is not allowed; expected a directory of its own for the run" in str(result.exception)
    assert (out / "summary.json").read_text() == "notes"
