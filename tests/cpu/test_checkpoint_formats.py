"""Checkpoints of redline 0.1 still load; another version's format, or another model's checkpoint, is refused."""

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
from redline.checkpoint import CheckpointError, open_checkpoint, read_checkpoint, step_dir
from redline.checkpoint.layout import FormatError
from redline.checkpoint.sharded import save_sharded
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


def test_resume_auto_stops_at_a_newer_redlines_checkpoint_rather_than_go_back_past_it(tmp_path):
    """Before, --resume auto skipped a newer version's checkpoint as corrupt and resumed from the one before: the
    resumed run trained those steps again and wrote its own checkpoint of the same step over the newer one."""
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        for step in (1, 2, 3):
            rt.save(step_dir(tmp_path, step), step=step)
    newer = tmp_path / "step-00000002" / "manifest.json"
    newer.write_text(newer.read_text().replace('"redline-whole-2"', '"redline-whole-9"'))
    damaged = tmp_path / "step-00000003" / "manifest.json"
    damaged.write_text(damaged.read_text().replace('"redline-whole-2"', '"r\\u00e9dline-whole-2"'))  # a flipped bit
    with pytest.raises(FormatError) as raised:
        open_checkpoint("auto", tmp_path)
    assert str(raised.value) == (
        f"{tmp_path / 'step-00000002'}: checkpoint format 'redline-whole-9' is not one this redline reads "
        "('redline-whole-2', 1, 'redline-sharded-2', 'redline-sharded-1')\nhint: resume with the version of redline "
        "that wrote it; --resume auto does not go back past it to an older checkpoint, whose run would write over it "
        "(to go on from an older one, pass it as --resume PATH with another --out)"
    )
    newer.unlink()  # no longer a newer version's: a checkpoint without a manifest, skipped as before
    assert open_checkpoint("auto", tmp_path).step == 1  # the damaged manifest is skipped as corrupt, as before


def test_a_newer_redlines_checkpoint_is_not_written_over(tmp_path):
    """Before, a run resumed from an older checkpoint into the same --out wrote its own step over the newer one's."""
    newer = step_dir(tmp_path, 2)
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        rt.save(newer, step=2)
        manifest = (newer / "manifest.json").read_text().replace('"redline-whole-2"', '"redline-whole-9"')
        (newer / "manifest.json").write_text(manifest)
        with pytest.raises(CheckpointError) as raised:
            rt.save(newer, step=2)
        damaged = step_dir(tmp_path, 3)
        rt.save(damaged, step=3)
        (damaged / "manifest.json").write_text('{"format": "r\\u00e9dline-whole-2", "files": {}}')  # a flipped bit
        rt.save(damaged, step=3)  # a damaged checkpoint is written over, as before
    assert str(raised.value) == (
        f"{newer} is a checkpoint of another version of redline (format 'redline-whole-9'), which writing a checkpoint "
        "there would replace; nothing was written\nhint: pass a new directory for the checkpoint (or an earlier "
        f"checkpoint's, which it replaces), or move {newer} elsewhere first"
    )
    assert (newer / "manifest.json").read_text() == manifest
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]  # nothing staged
    assert read_checkpoint(damaged).step == 3


def mlp(hidden: int, extra_layer: bool = False) -> nn.Sequential:
    layers = [nn.Linear(4, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 2)]
    return nn.Sequential(*layers, *([nn.Linear(2, 2)] if extra_layer else []))


def save_in_format(path: Path, model: nn.Module, format: str) -> None:
    if format == "whole":
        with redline.Runtime(devices="cpu") as rt:
            rt.setup(model, lambda params: torch.optim.AdamW(params))
            rt.save(path)
    else:  # every rank its shards; one process here, without a process group
        optimizer = torch.optim.AdamW(model.parameters())
        save_sharded(path, model, optimizer, runtime_state={}, extra={}, plan={}, step=1)


@pytest.mark.parametrize("format", ["whole", "sharded"])
def test_loading_the_checkpoint_of_another_model_names_the_differences(tmp_path, format):
    path = tmp_path / "step-00000001"
    save_in_format(path, mlp(16), format)
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(mlp(8, extra_layer=True), lambda params: torch.optim.AdamW(params))
        before = {name: tensor.clone() for name, tensor in rt.module.state_dict().items()}
        with pytest.raises(CheckpointError) as raised:
            rt.load(path)
        after = rt.module.state_dict()
    assert str(raised.value) == (
        f"{path}: the checkpoint's model differs from this run's model: missing from the checkpoint: 4.weight, "
        "4.bias; shapes differ: 0.weight ([16, 4] in the checkpoint, [8, 4] in this model), 0.bias ([16] in the "
        "checkpoint, [8] in this model), 1.weight ([16, 16] in the checkpoint, [8, 8] in this model) and 4 more\n"
        "hint: this run's model is not the one that wrote the checkpoint (another --task-arg, or changed model "
        "code, changes its shapes): resume with the same --task-arg values as the run that wrote it, or load a "
        "checkpoint of this model "
        "(redline train: --resume one of this model, or another --out)"
    )
    assert all(torch.equal(before[name], after[name]) for name in before), "nothing is loaded"


@pytest.mark.parametrize("format", ["whole", "sharded"])
def test_a_checkpoint_with_tensors_this_model_lacks_is_refused(tmp_path, format):
    path = tmp_path / "step-00000001"
    save_in_format(path, mlp(8, extra_layer=True), format)
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(mlp(8), lambda params: torch.optim.AdamW(params))
        lacks = r"differs from this run's model: not in this model: 4\.\w+, 4\.\w+\n"
        with pytest.raises(CheckpointError, match=lacks):
            rt.load(path)
