"""The checkpoint directory: what killed writes leave is removed, and a checkpoint skipped on resume is named."""

import contextlib
import logging
import os
import shutil
import stat

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.checkpoint import CheckpointError, clean_staging, find_checkpoints, open_checkpoint, prune, step_dir
from redline.errors import ConfigError
from redline.train.trainer import Trainer


def tiny_task() -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randint(0, 2, (32,), generator=gen))
    return redline.Task(model=lambda: nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8, epochs=5)  # fmt: skip


def test_a_run_removes_the_staging_directories_killed_writes_left(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    for leftover in (".tmp-step-00000007", ".tmp-step-00000300"):  # a killed run's, at any step
        (root / leftover).mkdir(parents=True)
        (root / leftover / "model.safetensors").write_bytes(b"half of it")
    (root / "notes").mkdir()  # not a checkpoint's: left alone
    with caplog.at_level(logging.INFO, logger="redline"):
        Trainer(tiny_task(), runtime=redline.RuntimeOptions(devices="cpu"), max_steps=2, out_dir=tmp_path,
                progress=False).fit()  # fmt: skip
    assert sorted(path.name for path in root.iterdir()) == ["notes", "step-00000002"]
    removed = [r.getMessage() for r in caplog.records if "staging" in r.getMessage()]
    assert removed == [
        f"removed 2 staging directories of checkpoint writes that never finished under {root}: "
        ".tmp-step-00000007, .tmp-step-00000300"
    ]


def test_a_newest_checkpoint_whose_manifest_cannot_be_read_is_named_and_skipped(tmp_path, caplog):
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        for step in (1, 2):
            rt.save(step_dir(tmp_path, step), step=step)
    newest = step_dir(tmp_path, 2)
    (newest / "manifest.json").write_text('{"format": "redline-whole-2", "files": {')  # cut short
    with caplog.at_level(logging.WARNING, logger="redline"):
        found = open_checkpoint("auto", tmp_path)
    assert found is not None and found.path == step_dir(tmp_path, 1)
    assert [c.step for c in find_checkpoints(tmp_path)] == [1]
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"skipping a corrupt checkpoint: {newest}: not a committed checkpoint (no readable ")
    assert "manifest.json" in warning and "Expecting" in warning  # the JSON parser's reason


def test_writing_a_step_again_never_leaves_it_missing(tmp_path, monkeypatch):
    from pathlib import Path

    from redline.checkpoint.layout import commit, file_entry, read_checkpoint, stage

    def write(final: Path, text: str) -> None:
        tmp = stage(final)
        (tmp / "weights.txt").write_text(text)
        commit(tmp, final, format="redline-whole-2", step=7, files={"weights.txt": file_entry(tmp / "weights.txt")})

    final = step_dir(tmp_path, 7)
    write(final, "old")
    renames = []

    def crash_after_one_rename(self: Path, target: Path) -> Path:  # the process dies between two renames
        if renames:
            raise KeyboardInterrupt("killed")
        renames.append(target)
        return real_rename(self, target)

    real_rename = Path.rename
    monkeypatch.setattr(Path, "rename", crash_after_one_rename)
    with contextlib.suppress(KeyboardInterrupt):
        write(final, "new")
    monkeypatch.undo()
    assert read_checkpoint(final).step == 7  # still a committed checkpoint, the old one or the new one
    assert (final / "weights.txt").read_text() in ("old", "new")
    assert [c.path for c in find_checkpoints(tmp_path)] == [final]


def test_resume_auto_refuses_a_run_whose_every_checkpoint_is_corrupt_and_leaves_them(tmp_path):
    def trainer(**changes) -> Trainer:
        return Trainer(tiny_task(), runtime=redline.RuntimeOptions(devices="cpu"), out_dir=tmp_path, progress=False,
                       checkpoint_every=2, **changes)  # fmt: skip

    trainer(max_steps=4).fit()
    root = tmp_path / "checkpoints"
    for found in find_checkpoints(root):  # a bit flipped in each: the size unchanged, the checksum not
        blob = bytearray((found.path / "optimizer.pt").read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        (found.path / "optimizer.pt").write_bytes(bytes(blob))
    before = {path: path.read_bytes() for path in root.rglob("*") if path.is_file()}
    with pytest.raises(CheckpointError) as raised:
        trainer(max_steps=8, resume="auto").fit()
    message = str(raised.value)
    assert message.startswith(f"{root}: no checkpoint there verifies (2 tried), so the run cannot resume")
    for step in (2, 4):
        assert f"{step_dir(root, step)}: optimizer.pt does not match its checksum" in message
    assert f"hint: a new run there would write over them; to start over, delete {root}" in message
    assert {path: path.read_bytes() for path in root.rglob("*") if path.is_file()} == before  # nothing written


def test_pruning_keeps_a_resumed_runs_valid_checkpoints_before_the_corrupt_one_it_skipped(tmp_path):
    """Resumed past a corrupt step 4 with checkpoints every 3 steps, keeping one: pruning kept the corrupt step 4
    (the newest step) and deleted the run's own step 3, so the run could no longer resume at all."""

    def trainer(**changes) -> Trainer:
        return Trainer(tiny_task(), runtime=redline.RuntimeOptions(devices="cpu"), out_dir=tmp_path, progress=False,
                       **changes)  # fmt: skip

    trainer(max_steps=4, checkpoint_every=2).fit()
    root = tmp_path / "checkpoints"
    blob = bytearray((step_dir(root, 4) / "optimizer.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # the size unchanged, the checksum not
    (step_dir(root, 4) / "optimizer.pt").write_bytes(bytes(blob))
    trainer(max_steps=3, checkpoint_every=3, keep_checkpoints=1, resume="auto").fit()  # from step 2 to step 3
    assert [c.step for c in find_checkpoints(root)] == [3, 4]  # step 2 pruned; the corrupt 4 left for a look
    found = open_checkpoint("auto", root)
    assert found is not None and found.step == 3
    assert [c.step for c in found.skipped] == [4]


def test_resuming_from_a_checkpoint_a_crash_left_half_written_names_the_committed_one_beside_it(tmp_path):
    """Before, the hint described the form of a checkpoint path only, though the one to pass was beside it."""
    root = tmp_path / "run" / "checkpoints"
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        for step in (1, 2):
            rt.save(step_dir(root, step), step=step)
    staged = root / ".tmp-step-00000003"  # what a run killed while writing step 3's checkpoint leaves
    shutil.copytree(step_dir(root, 2), staged)
    (staged / "manifest.json").unlink()
    never = shutil.copytree(staged, step_dir(root, 4))  # a step directory whose manifest never came
    hint = (
        f"hint: resume from the newest committed checkpoint beside it, --resume {step_dir(root, 2)}, or --resume auto"
    )
    with pytest.raises(CheckpointError) as raised:
        open_checkpoint(str(staged), root)
    assert str(raised.value).startswith(
        f"{staged}: not a committed checkpoint (a checkpoint was being written there when its run was killed; it has "
        "no manifest.json)\n"
    )
    assert hint in str(raised.value)
    with pytest.raises(CheckpointError) as raised:
        open_checkpoint(str(never), root)
    assert str(raised.value).startswith(f"{never}: not a committed checkpoint (no readable manifest.json") and hint in (
        str(raised.value)
    )


def test_a_resumed_run_names_the_options_its_stored_plan_overrides_and_honours_a_device(tmp_path, caplog):
    def trainer(max_steps: int, **runtime) -> Trainer:
        return Trainer(tiny_task(), runtime=redline.RuntimeOptions(**runtime), out_dir=tmp_path, progress=False,
                       max_steps=max_steps, resume="auto")  # fmt: skip

    trainer(2, devices="cpu", precision="fp32").fit()
    with caplog.at_level(logging.WARNING, logger="redline"):
        summary = trainer(4, precision="bf16-mixed").fit()
    assert summary.plan.precision.value == "fp32"  # the numerics it was started with
    [warning] = [r.getMessage() for r in caplog.records if "under the Plan" in r.getMessage()]
    assert "under the Plan it was written with: --precision bf16-mixed asked, the checkpoint's fp32 kept" in warning
    assert "start a run without --resume" in warning and "another --out" not in warning  # which kept it fp32 too
    if not torch.cuda.is_available():  # a device asked for now is used, not the stored one
        with pytest.raises(redline.DeviceUnavailableError, match="devices='cuda' was requested"):
            trainer(6, devices="cuda").fit()


def test_resuming_from_a_path_among_checkpoints_it_would_be_pruned_before_is_refused(tmp_path):
    def trainer(out, max_steps: int, resume) -> Trainer:
        return Trainer(tiny_task(), runtime=redline.RuntimeOptions(devices="cpu"), out_dir=out, progress=False,
                       max_steps=max_steps, checkpoint_every=2, resume=resume)  # fmt: skip

    root = tmp_path / "run" / "checkpoints"
    trainer(tmp_path / "run", 6, None).fit()
    with pytest.raises(ConfigError) as raised:  # back to step 2: its steps 4 and 6 would outlive this run's
        trainer(tmp_path / "run", 8, step_dir(root, 2)).fit()
    assert "holds checkpoints past step 2 (at 4, 6)" in str(raised.value)
    assert "--resume auto would continue those, not this run" in str(raised.value)
    assert "hint: to branch from step 2, pass another --out" in str(raised.value)
    assert [c.step for c in find_checkpoints(root)] == [2, 4, 6]  # nothing written, nothing pruned
    trainer(tmp_path / "other", 6, None).fit()
    with pytest.raises(ConfigError, match=r"(?s)holds checkpoints of its own .*hint: to continue the run there, "
                       r"pass --resume auto; to resume from \S+step-00000006 anew, pass another --out"):  # fmt: skip
        trainer(tmp_path / "other", 8, step_dir(root, 6)).fit()
    branch = trainer(tmp_path / "branch", 8, step_dir(root, 2)).fit()  # what the hint says: another --out
    assert branch.steps == 8 and [c.step for c in find_checkpoints(tmp_path / "branch" / "checkpoints")] == [4, 6, 8]
    assert trainer(tmp_path / "run", 8, step_dir(root, 6)).fit().steps == 8  # from its newest: the run goes on


def test_a_restarted_worker_goes_on_from_its_last_checkpoint_not_the_path_it_first_resumed(tmp_path, monkeypatch):
    def trainer(out, max_steps: int) -> Trainer:
        return Trainer(tiny_task(), runtime=redline.RuntimeOptions(devices="cpu"), out_dir=out, progress=False,
                       max_steps=max_steps, checkpoint_every=2, resume=first)  # fmt: skip

    first = None
    trainer(tmp_path / "start", 2).fit()
    first = step_dir(tmp_path / "start" / "checkpoints", 2)  # where the run (and its first attempt) resumed from
    trainer(tmp_path / "run", 4).fit()  # the first attempt: to step 4, then it "fails"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun starts the worker again, same arguments
    summary = trainer(tmp_path / "run", 6).fit()
    assert summary.resumed_from == str(step_dir(tmp_path / "run" / "checkpoints", 4))


def test_a_resume_path_that_is_a_run_directory_or_a_file_names_the_checkpoint_it_meant(tmp_path):
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        for step in (1, 2):
            rt.save(step_dir(tmp_path / "run" / "checkpoints", step), step=step)
    root, newest = tmp_path / "run" / "checkpoints", step_dir(tmp_path / "run" / "checkpoints", 2)
    for given in (tmp_path / "run", root):
        with pytest.raises(CheckpointError) as raised:
            open_checkpoint(str(given), root)
        assert str(raised.value).startswith(f"{given}: not a committed checkpoint")
        assert f"hint: pass the checkpoint directory itself, e.g. --resume {newest} (the newest there), or " in str(
            raised.value
        ) and f"--resume auto with --out {tmp_path / 'run'}" in str(raised.value)
    with pytest.raises(CheckpointError, match=r"--resume \S+step-00000001 \(the one that file is in\)"):
        open_checkpoint(str(step_dir(root, 1) / "model.safetensors"), root)
    final = tmp_path / "run" / "model.safetensors"  # the run's final weights: no optimizer, no position
    final.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"--resume \S+step-00000002 \(the newest of the run model\.safetensors"):
        open_checkpoint(str(final), root)
    with pytest.raises(CheckpointError, match=r"hint: pass a directory step-NNNNNNNN"):  # nothing near: as before
        open_checkpoint(str(tmp_path / "nowhere"), root)


def test_a_run_resumed_mid_epoch_with_another_seed_sees_each_sample_of_the_epoch_once(tmp_path, caplog):
    seen: list[int] = []

    class Recording(nn.Linear):  # notes the samples it trains on: each one's features are its index
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.extend(int(i) for i in x[:, 0])
            return super().forward(x)

    indices = torch.arange(40.0)
    data = TensorDataset(indices[:, None].repeat(1, 4), (indices % 2).long())
    task = redline.Task(model=lambda: Recording(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data,
                        batch_size=8)  # fmt: skip

    def trainer(max_steps: int, **runtime) -> Trainer:
        return Trainer(task, runtime=redline.RuntimeOptions(devices="cpu", **runtime), out_dir=tmp_path, trial="off",
                       progress=False, max_steps=max_steps, resume="auto")  # fmt: skip

    trainer(2).fit()  # 2 of the epoch's 5 batches
    with caplog.at_level(logging.WARNING, logger="redline"):
        trainer(5, seed=7).fit()  # the other 3, in the order the epoch began with
    assert sorted(seen) == list(range(40))  # before, the new seed's order: some samples twice, others never
    assert "--seed 7 asked, the checkpoint's 0 kept" in caplog.text


def test_a_run_resumed_without_an_out_dir_warns_that_it_writes_nothing(tmp_path, caplog):
    options = redline.RuntimeOptions(devices="cpu")
    Trainer(tiny_task(), runtime=options, out_dir=tmp_path, progress=False, max_steps=2).fit()
    newest = step_dir(tmp_path / "checkpoints", 2)
    with caplog.at_level(logging.WARNING, logger="redline"):
        Trainer(tiny_task(), runtime=options, progress=False, max_steps=4, resume=str(newest)).predict(torch.ones(2, 4))
        assert "without --out" not in caplog.text  # a prediction from a checkpoint writes nothing anyway
        Trainer(tiny_task(), runtime=options, progress=False, max_steps=4, resume=str(newest)).fit()
    message = " ".join(caplog.text.split())
    assert f"resuming from {newest} without --out (out_dir): this run writes no checkpoint, weights" in message
    assert f"hint: pass --out DIR (--out {tmp_path} continues that run there)" in message
    Trainer(tiny_task(), runtime=options, out_dir=tmp_path, progress=False, max_steps=3, resume="auto").fit()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="redline"):  # the run went on past step 2: --out there is refused
        Trainer(tiny_task(), runtime=options, progress=False, max_steps=4, resume=str(newest)).fit()
    message = " ".join(caplog.text.split())
    assert f"hint: pass --out DIR of its own: {tmp_path} goes on past this step, a branch from it needs another" in (
        message
    )


def test_a_replacement_cut_short_where_directories_cannot_be_swapped_is_put_back(tmp_path, monkeypatch):
    from pathlib import Path

    import redline.atomic as atomic

    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        for step in (1, 2):
            rt.save(step_dir(tmp_path, step), step=step)
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # a system (or NFS) without RENAME_EXCHANGE
        real_rename, renames = Path.rename, []

        def killed_after_the_first_rename(self: Path, target: Path) -> Path:
            if renames:
                raise KeyboardInterrupt("killed")
            renames.append(target)
            return real_rename(self, target)

        monkeypatch.setattr(Path, "rename", killed_after_the_first_rename)
        with contextlib.suppress(KeyboardInterrupt):
            rt.save(step_dir(tmp_path, 2), step=2, extra={"new": True})  # step 2 again: the old one moved aside
    monkeypatch.undo()
    assert not step_dir(tmp_path, 2).exists()  # before, --resume auto went back to step 1 and step 2 was lost
    found = open_checkpoint("auto", tmp_path)  # the new one was committed under its staging name: it goes in
    assert found is not None and found.path == step_dir(tmp_path, 2)
    assert torch.load(found.path / "extra.pt", weights_only=True) == {"new": True}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]


def test_an_older_checkpoint_moved_aside_comes_back_where_its_replacement_was_unfinished(tmp_path):
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        for step in (1, 2):
            rt.save(step_dir(tmp_path, step), step=step)
    step_dir(tmp_path, 2).rename(tmp_path / ".old-step-00000002-123")
    (tmp_path / ".tmp-step-00000002").mkdir()  # the replacement's files, without its manifest
    (tmp_path / ".tmp-step-00000002" / "model.safetensors").write_bytes(b"half of it")
    found = open_checkpoint("auto", tmp_path)
    assert found is not None and found.path == step_dir(tmp_path, 2)
    clean_staging(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]


def test_a_checkpoint_whose_manifest_no_longer_reads_is_pruned_once_the_run_goes_past_it(tmp_path):
    """Skipped by the resume, it was never pruned: find_checkpoints leaves out what has no readable manifest."""

    def trainer(**changes) -> Trainer:
        return Trainer(tiny_task(), runtime=redline.RuntimeOptions(devices="cpu"), out_dir=tmp_path, progress=False,
                       **changes)  # fmt: skip

    trainer(max_steps=4, checkpoint_every=2).fit()
    root = tmp_path / "checkpoints"
    (step_dir(root, 4) / "manifest.json").write_text("{bad")
    other = step_dir(root, 1)  # another version's checkpoint: never this version's to remove
    other.mkdir()
    (other / "manifest.json").write_text('{"format": "redline-checkpoint-v99", "files": {}}')
    trainer(max_steps=8, checkpoint_every=3, keep_checkpoints=1, resume="auto").fit()  # from step 2 to 8
    assert sorted(path.name for path in root.iterdir()) == ["step-00000001", "step-00000008"]


def test_a_copy_the_user_made_beside_the_checkpoints_is_never_pruned_counted_or_resumed_from(tmp_path):
    """A copy of step 2 kept as step-00000002-best was pruned with the run's old checkpoints."""

    def trainer(**changes) -> Trainer:
        return Trainer(tiny_task(), runtime=redline.RuntimeOptions(devices="cpu"), out_dir=tmp_path, progress=False,
                       checkpoint_every=2, keep_checkpoints=1, **changes)  # fmt: skip

    trainer(max_steps=2).fit()
    root = tmp_path / "checkpoints"
    best = root / "step-00000002-best"
    shutil.copytree(step_dir(root, 2), best)
    (root / "step-notes").mkdir()
    (root / "step-notes" / "todo.txt").write_text("compare with the baseline")
    trainer(max_steps=6, resume="auto").fit()
    assert sorted(path.name for path in root.iterdir()) == ["step-00000002-best", "step-00000006", "step-notes"]
    assert open_checkpoint(best, root).step == 2  # still a whole checkpoint, for --resume PATH
    assert (root / "step-notes" / "todo.txt").read_text() == "compare with the baseline"


def test_pruning_keeps_an_older_checkpoint_in_place_of_one_damaged_since_it_was_written(tmp_path, caplog):
    """Step 2 cut short after its commit still counted among the two kept: step 1 was pruned, and with step 3
    damaged too no checkpoint was left to resume from."""
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        for step in (1, 2, 3):
            rt.save(step_dir(tmp_path, step), step=step)
            if step == 2:  # damaged on disk after its commit: a file cut short
                weights = step_dir(tmp_path, 2) / "model.safetensors"
                weights.write_bytes(weights.read_bytes()[:-8])
    with caplog.at_level(logging.WARNING, logger="redline"):
        prune(tmp_path, 2)
    assert [c.step for c in find_checkpoints(tmp_path)] == [1, 2, 3]  # 1 kept in the damaged 2's place
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{step_dir(tmp_path, 2)}: model.safetensors is truncated (")
    assert "not counted among the 2 checkpoints kept" in warning
    optimizer = step_dir(tmp_path, 3) / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes() + b"x")  # the newest damaged as well
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="redline"):
        found = open_checkpoint("auto", tmp_path)
    assert found is not None and found.step == 1  # the last good one
    assert [step_dir(tmp_path, step) for step in (3, 2)] == [c.path for c in found.skipped]
    assert "optimizer.pt has grown since it was written (" in caplog.text


def test_a_resumed_runs_final_loss_is_the_mean_of_its_last_steps_as_an_unbroken_runs_is(tmp_path):
    def fit(out, steps, **changes):
        return Trainer(tiny_task(), runtime=redline.RuntimeOptions(devices="cpu", seed=0), max_steps=steps,
                       out_dir=tmp_path / out, progress=False, **changes).fit()  # fmt: skip

    whole = fit("whole", 12)
    fit("split", 11)
    resumed = fit("split", 12, resume="auto")  # one step of its own: the mean of 20 steps goes on from the stored 11
    assert resumed.steps == 12 and resumed.resumed_from is not None
    assert resumed.final_loss == pytest.approx(whole.final_loss, rel=1e-6)


def test_weights_and_checkpoint_files_have_the_mode_the_umask_gives_and_a_private_file_stays_private(tmp_path):
    """Before, safetensors left every weights file 0600, readable by its owner alone, unlike the files beside it."""
    old = os.umask(0o022)
    try:
        private = tmp_path / "private.safetensors"
        private.write_bytes(b"")
        private.chmod(0o600)
        with redline.Runtime(devices="cpu", compile="off") as rt:
            rt.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.1))
            rt.save_weights(tmp_path / "weights.safetensors")
            rt.save_weights(private)
            rt.save(tmp_path / "checkpoint")
    finally:
        os.umask(old)
    modes = {
        path.name: stat.S_IMODE(path.stat().st_mode)
        for path in [*tmp_path.iterdir(), *(tmp_path / "checkpoint").iterdir()]
    }
    assert modes.pop("checkpoint") == 0o755 and modes.pop("private.safetensors") == 0o600
    assert modes and set(modes.values()) == {0o644}, modes
    assert "model.safetensors" in modes and "weights.safetensors" in modes


def _sgd_run(
    tmp_path, lr: float, *, save: bool, scheduled: bool = False, plateau: bool = False
) -> torch.optim.Optimizer:
    """A Runtime run of SGD at ``lr`` (with a warm-up schedule, if ``scheduled``, or a plateau's decay, as a loop's
    own decay would be) that saves or loads ``tmp_path``."""
    with redline.Runtime(devices="cpu", compile="off", seed=0) as rt:
        _, opt = rt.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9))
        if scheduled:
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
        if save:
            for _ in range(3):
                opt.step()  # no gradients: the weights stay, and the schedule moves the lr
                if scheduled:
                    schedule.step()
            if plateau:
                for group in opt.param_groups:
                    group["lr"] /= 10
            rt.save(tmp_path / "ck")
        else:
            rt.load(tmp_path / "ck")
    return opt


def test_loading_names_an_optimizer_option_the_checkpoint_overrides(tmp_path, caplog):
    """Before, a resume with another learning rate (--task-arg lr=0.1) went on with the checkpoint's, unsaid."""
    _sgd_run(tmp_path, 0.003, save=True)
    with caplog.at_level(logging.WARNING, logger="redline"):
        opt = _sgd_run(tmp_path, 0.1, save=False)
    assert opt.param_groups[0]["lr"] == 0.003  # torch's load keeps the saved options: now it is said
    [warning] = [r.getMessage() for r in caplog.records]
    assert "this run's optimizer has lr 0.1, the checkpoint's 0.003, and goes on with the checkpoint's" in warning
    assert "hint: to train on with other options, set them in optimizer.param_groups after loading" in warning


def test_a_resumed_runs_checkpoint_records_the_options_it_trained_with_not_its_factorys(tmp_path, caplog):
    """A run resumed with lr=0.03 trained at the checkpoint's 0.003 but recorded 0.03: the next resume with no flag
    warned falsely of 0.03, and one asking 0.03 again was not warned."""
    _sgd_run(tmp_path, 0.003, save=True)
    with redline.Runtime(devices="cpu", compile="off", seed=0) as rt:  # resumed asking 0.03: warned, trains at 0.003
        _, opt = rt.setup(nn.Linear(2, 2), lambda params: torch.optim.SGD(params, lr=0.03, momentum=0.9))
        rt.load(tmp_path / "ck")
        assert opt.param_groups[0]["lr"] == 0.003
        rt.save(tmp_path / "ck2")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="redline"):
        (tmp_path / "ck").rename(tmp_path / "first")
        (tmp_path / "ck2").rename(tmp_path / "ck")
        _sgd_run(tmp_path, 0.003, save=False)
        assert [r.getMessage() for r in caplog.records] == []
        _sgd_run(tmp_path, 0.03, save=False)
    assert "this run's optimizer has lr 0.03, the checkpoint's 0.003" in caplog.records[-1].getMessage()


def test_a_checkpoint_mid_schedule_loads_without_a_warning_where_the_options_are_the_same(tmp_path, caplog):
    """The lr a schedule moved is no change of options: each side's optimizer is compared as it was built."""
    _sgd_run(tmp_path, 0.5, save=True, scheduled=True)
    with caplog.at_level(logging.WARNING, logger="redline"):
        _sgd_run(tmp_path, 0.5, save=False, scheduled=True)
        _sgd_run(tmp_path, 0.5, save=False)  # a scheduler not built yet
    assert [r.getMessage() for r in caplog.records] == []
    _sgd_run(tmp_path, 0.5, save=True, plateau=True)  # ReduceLROnPlateau, or a loop's own decay, sets no initial_lr
    with caplog.at_level(logging.WARNING, logger="redline"):
        opt = _sgd_run(tmp_path, 0.5, save=False)
    assert [r.getMessage() for r in caplog.records] == [] and opt.param_groups[0]["lr"] == 0.05
    with caplog.at_level(logging.WARNING, logger="redline"):
        _sgd_run(tmp_path, 0.25, save=False, scheduled=True)
    assert "has lr 0.25, the checkpoint's 0.5," in caplog.records[-1].getMessage()


def test_no_checkpoint_to_resume_from_is_said_once_for_the_job_by_rank_0(tmp_path, caplog):
    """Before, every rank of `redline train --nproc N --resume auto` printed the warning."""
    from redline.parallel.env import DistEnv
    from redline.train.resume import find_resume

    with caplog.at_level(logging.WARNING, logger="redline"):
        for rank in (1, 0):
            assert find_resume("auto", tmp_path / "checkpoints", DistEnv(rank=rank, world_size=2)) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"no checkpoint under {tmp_path / 'checkpoints'}; starting from scratch"
    ]


def test_a_corrupt_checkpoint_resumed_by_path_names_the_earlier_one_beside_it(tmp_path):
    """The hint said --resume auto, which in a new --out started from scratch beside two good checkpoints."""
    run = tmp_path / "run"
    Trainer(tiny_task(), runtime=redline.RuntimeOptions(devices="cpu"), out_dir=run, progress=False, max_steps=4,
            checkpoint_every=2).fit()  # fmt: skip
    root = run / "checkpoints"
    blob = bytearray((step_dir(root, 4) / "optimizer.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (step_dir(root, 4) / "optimizer.pt").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError) as raised:
        open_checkpoint(step_dir(root, 4), tmp_path / "elsewhere" / "checkpoints")
    assert str(raised.value).endswith(
        f"hint: the checkpoint is corrupt; resume from an earlier one beside it, --resume {step_dir(root, 2)}, or with "
        f"--resume auto --out {run} (which skips it)"
    )


def test_a_run_killed_while_pruning_leaves_no_half_removed_checkpoint(tmp_path, monkeypatch):
    """The removal deleted files of a checkpoint in place: a kill amid it left one with its manifest, so corrupt."""
    with redline.Runtime(devices="cpu") as rt:
        rt.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        for step in (1, 2, 3):
            rt.save(step_dir(tmp_path, step), step=step)
    removing = shutil.rmtree

    def killed_midway(path, ignore_errors=False):  # the weights gone, then the process killed (SIGKILL)
        if (path / "manifest.json").is_file():
            (path / "model.safetensors").unlink()
            raise KeyboardInterrupt
        removing(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        prune(tmp_path, keep=2)
    monkeypatch.undo()
    assert [c.step for c in find_checkpoints(tmp_path)] == [2, 3]  # step 1 is no longer a checkpoint at all
    found = open_checkpoint("auto", tmp_path)
    assert found is not None and found.step == 3 and not found.skipped
    clean_staging(tmp_path)  # what the next run does first: the leftover goes
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
