"""A commit killed between its manifest and its rename: a checkpoint staged whole is put in place, not discarded."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.checkpoint import clean_staging, find_checkpoints, layout, open_checkpoint, recover, step_dir
from redline.runtime.runtime import Runtime
from redline.train.trainer import Trainer


class Killed(BaseException):
    """What SIGKILL would do there: nothing after it runs (no except Exception catches it)."""


def kill_in_commit(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Kill the commit of ``step``'s checkpoint after its manifest is written and fsynced, before its rename."""
    real = layout.commit_directory

    def commit(tmp: Path, final: Path) -> None:
        if final.name == step_dir(final.parent, step).name:
            raise Killed
        real(tmp, final)

    monkeypatch.setattr(layout, "commit_directory", commit)


def saved(root: Path, steps: list[int], monkeypatch: pytest.MonkeyPatch, killed: int) -> nn.Module:
    """Save a small model's checkpoint at each of ``steps``, the commit of ``killed`` cut short; return the model."""
    kill_in_commit(monkeypatch, killed)
    with Runtime(devices="cpu") as rt:
        model, _ = rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        for step in steps:
            with torch.no_grad():
                rt.module.weight.fill_(step)
            if step == killed:
                with pytest.raises(Killed):
                    rt.save(step_dir(root, step), step=step)
            else:
                rt.save(step_dir(root, step), step=step)
    monkeypatch.undo()
    return model


def test_a_step_staged_whole_is_renamed_into_place_and_resumed_from(tmp_path, monkeypatch, caplog):
    """Before, recover left it and clean_staging removed it: --resume auto went back to the step before."""
    saved(tmp_path, [1, 2], monkeypatch, killed=2)
    assert (tmp_path / ".tmp-step-00000002" / "manifest.json").is_file() and not step_dir(tmp_path, 2).exists()
    with caplog.at_level(logging.WARNING, logger="redline"):
        found = open_checkpoint("auto", tmp_path)  # recovers first, then verifies what it picks
    assert found is not None and found.step == 2 and found.path == step_dir(tmp_path, 2)
    assert f"put back {step_dir(tmp_path, 2)}: a killed run had written it whole" in caplog.text
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]
    with Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.load(found)
        assert torch.equal(rt.module.weight, torch.full((2, 4), 2.0))


def test_a_staged_step_not_whole_or_whose_name_is_taken_is_not_put_in_place(tmp_path, monkeypatch):
    saved(tmp_path, [1, 2, 3], monkeypatch, killed=2)
    damaged = tmp_path / ".tmp-step-00000002" / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\0")  # the size it should have, not the bytes
    (step_dir(tmp_path, 3) / "first.txt").write_text("the step's first checkpoint")
    saved(tmp_path, [3], monkeypatch, killed=3)  # step 3 written again: killed before the swap, the old one stays
    recover(tmp_path)
    assert [c.step for c in find_checkpoints(tmp_path)] == [1, 3]
    assert (step_dir(tmp_path, 3) / "first.txt").is_file()
    assert clean_staging(tmp_path) == 2  # both go, as before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000001", "step-00000003"]


def test_a_trainer_killed_in_a_commit_after_the_manifest_resumes_from_that_step(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen))
    task = redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8, epochs=4)  # fmt: skip

    def trainer(**fields: object) -> Trainer:
        return Trainer(task, runtime=redline.RuntimeOptions(devices="cpu"), out_dir=tmp_path, progress=False,
                       max_steps=6, checkpoint_every=2, **fields)  # fmt: skip

    kill_in_commit(monkeypatch, 4)
    with pytest.raises(Killed):
        trainer().fit()
    monkeypatch.undo()
    summary = trainer(resume="auto").fit()
    assert summary.steps == 6 and summary.resumed_from == str(step_dir(tmp_path / "checkpoints", 4))
