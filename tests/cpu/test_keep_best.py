"""keep_best: the best evaluation's weights in OUT/best.safetensors, kept across a resume."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import quiet, tiny_task
from typer.testing import CliRunner

import redline
from redline.cli.main import app
from redline.errors import ConfigError
from redline.train import trainer as trainer_module
from redline.train.best import BestWeights


class Snapshots(redline.Callback):
    """The model's weights at each evaluation, by step."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_evaluate(self, trainer, step, metrics):
        self.at[step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def scripted(monkeypatch, by_step: dict[int, float], monitor: str = "val_loss") -> None:
    """Make each evaluation report ``by_step[step]`` as ``monitor`` (the other metric stays fixed)."""

    def evaluate(task, model, rt, batch_size, env=None, *, where="evaluation"):
        step = int(where.rsplit(" ", 1)[-1])
        other = "val_metric" if monitor == "val_loss" else "val_loss"
        return {monitor: by_step[step], other: 0.5}

    monkeypatch.setattr(trainer_module, "evaluate_model", evaluate)


def test_best_safetensors_holds_the_weights_of_the_lowest_val_loss(tmp_path, monkeypatch):
    scripted(monkeypatch, {2: 0.9, 4: 0.3, 6: 0.5, 8: 0.4})
    snapshots = Snapshots()
    summary = quiet(
        tiny_task(), max_steps=8, eval_every=2, out_dir=tmp_path, keep_best="val_loss", callbacks=[snapshots]
    ).fit()
    best = load_file(tmp_path / "best.safetensors")
    assert best.keys() == snapshots.at[4].keys()
    assert all(torch.equal(best[k], snapshots.at[4][k]) for k in best)
    assert not torch.equal(best["weight"], snapshots.at[8]["weight"])  # the final weights are elsewhere
    record = {"monitor": "val_loss", "value": 0.3, "step": 4, "path": str(tmp_path / "best.safetensors")}
    assert json.loads((tmp_path / "best.json").read_text()) == record
    assert summary.best == record
    assert json.loads((tmp_path / "summary.json").read_text())["best"] == record


def test_val_metric_keeps_the_highest_and_a_nan_never_counts(tmp_path, monkeypatch, caplog):
    scripted(monkeypatch, {2: 0.6, 4: float("nan"), 6: 0.8, 8: float("nan")}, monitor="val_metric")
    with caplog.at_level("WARNING", logger="redline"):
        summary = quiet(tiny_task(), max_steps=8, eval_every=2, out_dir=tmp_path, keep_best="val_metric").fit()
    assert summary.best is not None and (summary.best["step"], summary.best["value"]) == (6, 0.8)
    # said, once: a metric that is NaN at every evaluation kept nothing, and the run ended without a word
    assert caplog.text.count("--keep-best val_metric: the evaluation at step 4 gave nan, which is never the best") == 1
    assert "step 8 gave" not in caplog.text and "hint: look for NaN or inf in task.metric and val_data" in caplog.text


def test_a_resumed_run_replaces_the_best_only_with_better_weights(tmp_path, monkeypatch):
    scripted(monkeypatch, {2: 0.5, 4: 0.2, 6: 0.4, 8: 0.3})
    first = quiet(tiny_task(), max_steps=6, eval_every=2, checkpoint_every=2, out_dir=tmp_path, keep_best="val_loss")
    assert first.fit().best["step"] == 4
    kept = (tmp_path / "best.safetensors").read_bytes()
    again = quiet(
        tiny_task(), max_steps=8, eval_every=2, checkpoint_every=2, out_dir=tmp_path, keep_best="val_loss",
        resume="auto",
    )  # fmt: skip
    summary = again.fit()  # 0.3 at step 8 is no better than the 0.2 the checkpoint remembers
    assert (summary.best["step"], summary.best["value"]) == (4, 0.2)
    assert (tmp_path / "best.safetensors").read_bytes() == kept


def test_a_best_written_after_the_checkpoint_a_crash_went_back_to_still_counts(tmp_path):
    (tmp_path / "best.safetensors").write_bytes(b"weights of step 6")
    best = BestWeights("val_loss", tmp_path)
    later = {"monitor": "val_loss", "value": 0.1, "step": 6}
    (tmp_path / "best.json").write_text(json.dumps(later))
    best.load_state_dict({"monitor": "val_loss", "value": 0.2, "step": 4})
    assert (best.step, best.value) == (6, 0.1)  # the file on disk is step 6's: the record must say so
    for stale in ({**later, "monitor": "val_metric"}, {**later, "step": 2}, {**later, "value": 0.3}):
        (tmp_path / "best.json").write_text(json.dumps(stale))
        best.load_state_dict({"monitor": "val_loss", "value": 0.2, "step": 4})
        assert (best.step, best.value) == (4, 0.2)
    best.load_state_dict({"monitor": "val_metric", "value": 0.9, "step": 4})  # watched another metric: afresh
    assert (best.step, best.value) == (None, None)
    (tmp_path / "best.json").write_text("{not json")
    best.load_state_dict({"monitor": "val_loss", "value": 0.2, "step": 4})
    assert (best.step, best.value) == (4, 0.2)


def test_keep_best_that_could_write_or_compare_nothing_is_refused(tmp_path):
    refused = {
        "no out_dir": ({}, tiny_task(), r"keep_best='val_loss' is not allowed; expected it with out_dir=DIR"),
        "no val_data": ({"out_dir": tmp_path}, tiny_task(val_data=None), r"expected it with a task that has val_data"),
    }
    for kwargs, task, said in refused.values():
        with pytest.raises(ConfigError, match=said):
            quiet(task, max_steps=2, keep_best="val_loss", **kwargs)
    with pytest.raises(
        ConfigError, match=r"has no metric.*\nhint: pass keep_best='val_loss', or give the task metric="
    ):
        quiet(tiny_task(metric=None), max_steps=2, keep_best="val_metric", out_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"keep_best='best' is not allowed; expected one of 'off', 'val_loss'"):
        quiet(tiny_task(), max_steps=2, keep_best="best", out_dir=tmp_path)


def test_the_cli_keeps_the_best_and_says_where(tmp_path):
    result = CliRunner().invoke(
        app,
        ["train", "--task", "example:digits", "--max-steps", "4", "--eval-every", "2", "--batch-size", "32",
         "--trial", "off", "--no-progress", "--out", str(tmp_path), "--keep-best", "val_metric"],
        env={"COLUMNS": "200"},  # one row per figure (pytest-xdist's workers set COLUMNS=80)
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "best.json").read_text())
    assert record["monitor"] == "val_metric" and record["step"] in (2, 4)
    assert "best weights" in result.output and "best.safetensors" in result.output
    assert load_file(tmp_path / "best.safetensors").keys() == load_file(tmp_path / "model.safetensors").keys()
    refused = CliRunner().invoke(app, ["train", "--task", "example:chargpt", "--keep-best", "val_metric", "--out",
                                       str(tmp_path / "gpt")])  # fmt: skip
    assert "hint: pass --keep-best 'val_loss', or give the task metric=..." in str(refused.exception)


def test_a_metric_without_val_data_never_runs_and_the_trainer_says_so(caplog):
    with caplog.at_level("WARNING", logger="redline"):
        quiet(tiny_task(val_data=None), max_steps=2)
    assert "task 'task' has a metric but no val_data: no metric is computed (give it val_data=...)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="redline"):
        quiet(tiny_task(), max_steps=2)
        quiet(tiny_task(val_data=None, metric=None), max_steps=2)
    assert "no metric is computed" not in caplog.text


def test_a_branch_into_a_new_out_dir_takes_the_best_along_or_starts_it_afresh(tmp_path, monkeypatch, caplog):
    """The summary named NEW/best.safetensors for the checkpoint's best, which stayed in the old out_dir, and no
    later evaluation beat it: a file never written."""
    scripted(monkeypatch, {2: 0.5, 4: 0.2, 6: 0.4, 8: 0.3, 10: 0.35})
    old, new = tmp_path / "old", tmp_path / "new"
    keep = dict(eval_every=2, checkpoint_every=4, keep_best="val_loss")
    assert quiet(tiny_task(), max_steps=8, out_dir=old, **keep).fit().best["step"] == 4
    branch = quiet(tiny_task(), max_steps=10, out_dir=new, resume=str(old / "checkpoints" / "step-00000008"), **keep)
    summary = branch.fit()  # 0.35 at step 10 does not beat step 4's 0.2: the old run's file comes along
    assert summary.best == {"monitor": "val_loss", "value": 0.2, "step": 4, "path": str(new / "best.safetensors")}
    assert (new / "best.safetensors").read_bytes() == (old / "best.safetensors").read_bytes()
    assert json.loads((new / "best.json").read_text()) == summary.best

    scripted(monkeypatch, {2: 0.5, 4: 0.2, 6: 0.4, 8: 0.1})
    old, new = tmp_path / "old2", tmp_path / "new2"
    assert quiet(tiny_task(), max_steps=8, out_dir=old, **keep).fit().best["step"] == 8  # step 4's weights replaced
    branch = quiet(tiny_task(), max_steps=6, out_dir=new, resume=str(old / "checkpoints" / "step-00000004"), **keep)
    summary = branch.fit()  # step 4's best is gone: step 6's 0.4 is the branch's first
    assert (summary.best["step"], summary.best["value"]) == (6, 0.4) and (new / "best.safetensors").is_file()
    # the file is there, holding step 8's: it read "are gone"
    said = "best weights ({}, of step 4) were replaced there by a later best (of step 8): --keep-best starts afresh"
    assert said.format(old / "best.safetensors") in caplog.text
