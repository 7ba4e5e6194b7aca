"""A run resumed from another run's checkpoint into an --out of its own, with nothing left to train there."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from small_tasks import small

import redline
from redline.errors import ConfigError
from redline.train.callbacks import EarlyStopping
from redline.train.trainer import Trainer

TASKS = Path(__file__).with_name("small_tasks.py")


def files(out: Path) -> dict[str, str]:
    """The run's files under ``out`` (the lock aside), by path, as hashes of their bytes."""
    found = (p for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in found}


def train(*args: str) -> list[str]:
    return ["train", "--task", f"{TASKS}:small", "--devices", "cpu", "--seed", "3", "--no-progress", *args]


def test_a_branch_past_max_steps_is_refused_writing_nothing_and_the_command_its_hint_gives_trains(
    tmp_path: Path, redline_here
) -> None:
    """It wrote results and no checkpoint into --out, and the command its warning gave (--max-steps 30) was then
    refused there as a run among another run's logs."""
    ref, branch = tmp_path / "ref", tmp_path / "branch"
    assert redline_here(*train("--out", str(ref), "--max-steps", "18", "--checkpoint-every", "6")).returncode == 0
    found = ref / "checkpoints" / "step-00000018"
    refused = redline_here(*train("--out", str(branch), "--resume", str(found), "--max-steps", "12"))
    assert refused.returncode == 2
    assert f"error: nothing to train: {found} is at step 18, past the end of this run (--max-steps 12" in refused.stderr
    assert f"resumed from it into out_dir='{branch}', this run would write its results there" in refused.stderr
    assert "hint: to train 12 more, pass --max-steps 30 (max_steps=30)" in refused.stderr
    assert files(branch) == {}
    hinted = redline_here(*train("--out", str(branch), "--resume", str(found), "--max-steps", "30", "--json"))
    assert hinted.returncode == 0, hinted.stderr
    assert [p.name for p in (branch / "checkpoints").iterdir()] == ["step-00000030"]


@pytest.mark.parametrize(
    ("more", "hint"),
    [({}, "pass --epochs (max_epochs=) larger than 3"), ({"max_steps": 21}, "pass --max-steps (max_steps=) larger")],
    ids=["the task's epochs", "max_steps"],
)
def test_a_branch_at_the_end_of_its_length_is_refused_and_a_larger_one_trains_there(
    tmp_path: Path, more: dict[str, int], hint: str
) -> None:
    options = redline.RuntimeOptions(devices="cpu", seed=3)
    ref, branch = tmp_path / "ref", tmp_path / "branch"
    Trainer(small(), runtime=options, progress=False, out_dir=ref, checkpoint_every=7).fit()
    found = ref / "checkpoints" / "step-00000021"
    with pytest.raises(ConfigError) as refused:
        Trainer(small(), runtime=options, progress=False, out_dir=branch, resume=found, **more).fit()
    assert str(refused.value).startswith(f"nothing to train: {found} is at step 21, the end of this run")
    assert hint in str(refused.value) and files(branch) == {}
    longer = {"max_steps": 28} if more else {"max_epochs": 4}
    summary = Trainer(small(), runtime=options, progress=False, out_dir=branch, resume=found, **longer).fit()
    assert summary.steps == 28 and (branch / "checkpoints" / "step-00000028").is_dir()


def test_a_branch_early_stopping_ends_at_once_is_refused_naming_its_patience(tmp_path: Path) -> None:
    options = redline.RuntimeOptions(devices="cpu", seed=3)

    def trainer(out: Path, **kwargs: object) -> Trainer:
        stopping = [EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)]  # no evaluation improves enough
        return Trainer(
            small(), runtime=options, progress=False, out_dir=out, eval_every=2, callbacks=stopping, **kwargs
        )

    assert trainer(tmp_path / "ref").fit().stopped == "early stopping"
    found = next((tmp_path / "ref" / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match=r"hint: to train further, raise --early-stopping-patience \(EarlyStopping"):
        trainer(tmp_path / "branch", resume=found).fit()


def test_the_run_resumed_in_its_own_out_with_nothing_to_train_is_left_as_it_was(tmp_path: Path) -> None:
    options = redline.RuntimeOptions(devices="cpu", seed=3)
    Trainer(small(), runtime=options, progress=False, out_dir=tmp_path, checkpoint_every=7).fit()
    before, found = files(tmp_path), tmp_path / "checkpoints" / "step-00000021"
    for resume in ("auto", found):
        assert Trainer(small(), runtime=options, progress=False, out_dir=tmp_path, resume=resume).fit().steps == 21
        assert files(tmp_path) == before
