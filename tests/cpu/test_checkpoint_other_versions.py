"""An out_dir's checkpoints of another version of redline count when a run decides about the ones already there."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.checkpoint import find_checkpoints, other_versions, step_dir
from redline.errors import ConfigError
from redline.train.trainer import Trainer


def trainer(out: Path, max_steps: int, resume: str | Path | None = None) -> Trainer:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen))
    task = redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8, epochs=4)  # fmt: skip
    return Trainer(task, runtime=redline.RuntimeOptions(devices="cpu"), out_dir=out, progress=False,
                   max_steps=max_steps, checkpoint_every=1, resume=resume)  # fmt: skip


def files(out: Path) -> dict[Path, bytes]:
    return {path.relative_to(out): path.read_bytes() for path in out.rglob("*") if path.is_file()}


def test_another_versions_checkpoints_are_counted_before_a_run_mixes_its_own_with_them(tmp_path):
    """Before, they were left out: a new run among them, or one resumed from a step before them, trained and then
    failed at the step of theirs it could not write over (or went past it, leaving --resume auto stuck there)."""
    root = tmp_path / "checkpoints"
    trainer(tmp_path, 2).fit()
    manifest = step_dir(root, 2) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"redline-whole-2"', '"redline-whole-9"'))  # a newer redline's
    assert other_versions(root) == [2] and [c.step for c in find_checkpoints(root)] == [1]
    before = files(tmp_path)
    with pytest.raises(ConfigError) as raised:
        trainer(tmp_path, 4, resume=step_dir(root, 1)).fit()
    assert "holds checkpoints past step 1 (at 2 (another version of redline)); resumed from" in str(raised.value)
    assert files(tmp_path) == before  # nothing written, nothing pruned
    shutil.rmtree(step_dir(root, 1))  # another version's checkpoint alone: a new run was not refused at all
    before = files(tmp_path)
    with pytest.raises(ConfigError) as raised:
        trainer(tmp_path, 4).fit()
    assert str(raised.value) == (
        f"out_dir={str(tmp_path)!r} is not allowed; expected a directory of its own: it holds an earlier run's "
        "checkpoints (the newest at step 2, written by another version of redline), and a new run there would mix "
        "its checkpoints and logs with that run's\nhint: continue that run with the version of redline that wrote "
        f"it, or pass another out_dir=DIR; to start over, delete {root} and the logs beside it (metrics.csv, "
        "metrics.jsonl)"
    )
    assert files(tmp_path) == before
