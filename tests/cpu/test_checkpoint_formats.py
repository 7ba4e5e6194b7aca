"""Checkpoints of redline 0.1 still load; a format this version does not know is refused clearly."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_model
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.checkpoint import CheckpointError, read_checkpoint
from redline.runtime.seed import capture_rng
from redline.train.trainer import Trainer


def task() -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen))
    return redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8, epochs=20)  # fmt: skip


def commit_by_hand(path: Path, manifest_format: object, files: list[str], step: int) -> None:
    """Write the manifest redline 0.1 wrote: sizes, and SHA-256 for its whole format."""
    entries = {}
    for name in files:
        data = (path / name).read_bytes()
        entries[name] = {"bytes": len(data)}
        if manifest_format == 1:
            entries[name]["sha256"] = hashlib.sha256(data).hexdigest()
    manifest = {"format": manifest_format, "step": step, "files": entries}
    (path / "manifest.json").write_text(json.dumps(manifest))


def plan_of(trained: redline.Runtime) -> dict:
    return trained.explain().to_dict()


def test_a_whole_checkpoint_of_redline_0_1_resumes_the_trainer(tmp_path):
    with redline.Runtime(devices="cpu", seed=0) as rt:
        model, optimizer = rt.setup(nn.Linear(4, 2), lambda params: torch.optim.AdamW(params, lr=1e-2))
        path = tmp_path / "checkpoints" / "step-00000004"
        path.mkdir(parents=True)
        save_model(model, str(path / "model.safetensors"))
        torch.save(optimizer.state_dict(), path / "optimizer.pt")
        rng = capture_rng()
        position = {"step": 4, "epoch": 1, "batches_in_epoch": 0, "samples": 32}
        torch.save({"position": position, "scheduler": None, "scaler": None, "early_stopping": None, "rng": rng,
                    "rng_per_rank": [rng]}, path / "trainer.pt")  # fmt: skip
        (path / "plan.json").write_text(json.dumps(plan_of(rt)))
    commit_by_hand(path, 1, ["model.safetensors", "optimizer.pt", "trainer.pt", "plan.json"], 4)
    summary = Trainer(task(), runtime=redline.RuntimeOptions(devices="cpu"), max_steps=6, out_dir=tmp_path,
                      resume="auto", progress=False).fit()  # fmt: skip
    assert summary.steps == 6 and summary.resumed_from.endswith("step-00000004")


def test_a_sharded_checkpoint_of_redline_0_1_from_a_users_loop_loads_its_extra(tmp_path):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "step-00000003"
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    torch.save({"step": 3}, path / "extra.pt")  # the old save_sharded took any extra: no RNG, no position
    commit_by_hand(path, "redline-sharded-1", sorted(p.name for p in path.iterdir()), 3)
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        assert rt.load(path) == {"step": 3}
        assert torch.equal(rt.module.weight, model.weight)


def test_a_format_this_version_does_not_know_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "redline-whole-9", "step": 1, "files": {}}))
    with pytest.raises(CheckpointError, match=r"(?s)format 'redline-whole-9' is not one.*hint: .*another version"):
        read_checkpoint(tmp_path)
