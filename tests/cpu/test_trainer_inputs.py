"""The Trainer takes what users commonly hand it: a metric of NumPy's, predict's batch size, restarts."""

import csv
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_trainer import quiet, tiny_task  # the same tiny task and quiet Trainer
from torch import nn

import redline
from redline.errors import ConfigError, TaskError
from redline.train.trainer import Trainer


def accuracy(out: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    return (out.argmax(-1) == y).numpy().astype(np.float32)


@pytest.mark.parametrize(
    "metric",
    [
        lambda out, y: accuracy(out, y).mean(),  # np.float32: a float32 array's mean
        lambda out, y: np.asarray(accuracy(out, y).mean()),  # a 0-d array
        lambda out, y: accuracy(out, y).mean(keepdims=True),  # a one-element array
    ],
    ids=["float32-scalar", "0-d-array", "one-element-array"],
)
def test_a_metric_of_numpys_counts_as_the_same_number_in_a_float(metric):
    expected = quiet(tiny_task(), max_steps=2).fit().val_metric
    assert expected is not None and 0 < expected < 1
    assert quiet(tiny_task(metric=metric), max_steps=2).fit().val_metric == pytest.approx(expected)


def test_a_metric_of_numpy_that_is_not_one_number_is_still_refused():
    with pytest.raises(TaskError, match=r"tensor of shape \(8,\); expected one number"):
        quiet(tiny_task(metric=accuracy), max_steps=2).fit()


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_loss_of_shape_one_trains_and_logs_as_the_scalar_loss_does(tmp_path, grad_accum):
    """A loss kept as shape (1,) (keepdim=True, .view(1)) logged as [0.48] and failed at the first log point."""

    def logged(out, loss_fn):
        options = redline.RuntimeOptions(devices="cpu", seed=0, grad_accum=grad_accum)
        trainer = Trainer(tiny_task(loss_fn=loss_fn), max_steps=4, log_every=2, out_dir=out, progress=False,
                          runtime=options)  # fmt: skip
        summary = trainer.fit()
        assert summary.steps == 4 and summary.checkpoint is not None
        rows = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
        return [float(row["loss"]) for row in rows], summary.final_loss

    scalar = logged(tmp_path / "scalar", nn.functional.cross_entropy)
    assert logged(tmp_path / "one", lambda out, y: nn.functional.cross_entropy(out, y).reshape(1)) == scalar


@pytest.mark.parametrize("size", [0, -1, 2.5])
def test_predict_refuses_a_batch_size_that_is_no_count_of_items(size):
    trainer = quiet(tiny_task(), max_steps=1)
    trainer.fit()
    with pytest.raises(ConfigError, match=rf"batch_size={size}[^\n]*expected a positive integer"):
        trainer.predict(torch.randn(5, 4), batch_size=size)
    assert trainer.predict(torch.randn(5, 4), batch_size=2).shape == (5, 2)  # asked for, and taken


def test_a_restarted_worker_without_out_dir_says_it_trains_from_the_start_again(monkeypatch, caplog):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's count of this worker's restarts
    assert quiet(tiny_task(val_data=None), max_steps=2).fit().steps == 2
    said = [r.getMessage() for r in caplog.records if "restart" in r.getMessage()]
    assert len(said) == 1 and "no out_dir" in said[0] and "trains again from the start" in said[0], said
    assert "hint: pass --out DIR" in said[0]


def test_a_restarted_worker_with_out_dir_goes_on_without_that_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert quiet(tiny_task(val_data=None), max_steps=2, out_dir=tmp_path).fit().steps == 2
    assert not [r for r in caplog.records if "restarted after a failure" in r.getMessage()]


def test_train_with_max_restarts_and_no_out_warns_before_the_workers_start():
    result = subprocess.run(
        [sys.executable, "-m", "redline", "train", "--task", "example:digits", "--max-steps", "1", "--devices", "cpu",
         "--nproc", "1", "--max-restarts", "2", "--no-progress", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: --max-restarts 2 without --out: a restarted worker finds no checkpoint" in result.stderr
    assert "hint: add --out DIR" in result.stderr


def test_validation_figures_are_summed_in_float64_and_read_as_the_batches_gave_them():
    """Summed in float32, a metric of 0.6 on every batch was reported as 0.6000000238, in best.json too."""
    trainer = quiet(tiny_task(metric=lambda out, y: 0.6), max_steps=1)
    trainer.fit()
    assert trainer.evaluate()["val_metric"] == 0.6


def test_a_second_fit_says_it_trains_a_fresh_model_and_a_resumed_one_does_not(tmp_path, caplog):
    """A notebook's second fit(), meant to train on, built a new model from the task without a word."""
    trainer = quiet(tiny_task(val_data=None, metric=None), max_steps=2)
    trainer.fit()
    assert not [r for r in caplog.records if "fit() trains a fresh model" in r.getMessage()]
    trainer.fit()
    said = [r.getMessage() for r in caplog.records if "fit() trains a fresh model" in r.getMessage()]
    assert len(said) == 1 and "hint: to train on, fit once with more max_steps, or resume its checkpoint" in said[0]
    caplog.clear()
    resumed = quiet(tiny_task(val_data=None, metric=None), max_steps=2, out_dir=tmp_path, checkpoint_every=2)
    resumed.fit()
    resumed.config = dataclasses.replace(resumed.config, resume="auto", max_steps=4)
    assert resumed.fit().steps == 4  # went on from step 2's checkpoint: nothing replaced
    assert not [r for r in caplog.records if "fit() trains a fresh model" in r.getMessage()]


@pytest.mark.parametrize(("device", "summed"), [("cuda:1", "cuda:1"), ("mps", "cpu"), ("cpu", "cpu")])
def test_evaluation_sums_are_reduced_where_the_backend_and_float64_allow(device, summed):
    """NCCL reduces CUDA tensors alone (the sums were a CPU tensor); MPS has no float64 (they must not go there)."""
    from redline.train.evaluation import summed_on

    assert summed_on(torch.device(device)) == torch.device(summed)
