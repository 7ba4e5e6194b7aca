"""val_data's first batch is evaluated after a run's first step: a mistake in it stops the run then, not at its first
evaluation, and the check leaves the run as it would have been."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import redline
from redline.errors import TrainingError
from redline.train.trainer import Trainer


def task(val_data=None, metric=None) -> redline.Task:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    return redline.Task(
        model=lambda: nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3)),
        loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x, y), val_data=val_data, batch_size=8,
        metric=metric,
    )  # fmt: skip


def val_set(n: int = 12) -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen))


def kept_steps(out) -> list[str]:
    return sorted(path.name for path in (out / "checkpoints").iterdir())


def fit(made: redline.Task, out=None, **kwargs) -> redline.TrainSummary:
    kwargs = {"max_steps": 4, "log_every": 1, "out_dir": out, **kwargs}
    with Trainer(made, runtime=redline.RuntimeOptions(devices="cpu", seed=0), progress=False, **kwargs) as trainer:
        return trainer.fit()


def test_a_metric_that_fails_on_val_data_stops_the_run_after_its_first_step(tmp_path):
    def metric(outputs, targets):  # compares (8, 3) logits with (8,) labels: only val_data's batches reach it
        return (outputs == targets).float().mean()

    with pytest.raises(TrainingError, match=r"val_data.s first batch, after step 1") as failed:
        fit(task(val_set(), metric), tmp_path / "run", eval_every=3)
    assert "task.metric raised" in str(failed.value)
    assert kept_steps(tmp_path / "run") == ["step-00000001"], "stopped after step 1, not at step 3's evaluation"


def test_the_check_leaves_the_runs_random_streams_as_they_were(tmp_path):
    def drawing_metric(outputs, targets):  # draws from torch's stream: the check's call must not move dropout's masks
        return torch.rand(()).item()

    fit(task(), tmp_path / "plain")
    fit(task(val_set(), drawing_metric), tmp_path / "checked", eval_every=100)
    plain, checked = (
        load_file(tmp_path / "plain" / "model.safetensors"),
        load_file(tmp_path / "checked" / "model.safetensors"),
    )
    assert plain.keys() == checked.keys() and all(torch.equal(plain[k], checked[k]) for k in plain)


class Stream(IterableDataset):
    """val_set's items as a stream: a fresh pass each time, or (``one_pass``) one iterator that a pass uses up."""

    def __init__(self, one_pass: bool, n: int = 12) -> None:
        self.items, self.one_pass = list(val_set(n)), one_pass
        self.shared = iter(self.items)

    def __iter__(self):
        return self.shared if self.one_pass else iter(self.items)


class FromOneSource(Stream):
    """A stream whose every pass reads one source it holds (a file's lines): a fresh generator each time, over it."""

    def __iter__(self):
        return (item for item in self.shared)


@pytest.mark.parametrize("made", [lambda: Stream(one_pass=True), lambda: FromOneSource(one_pass=False)])
def test_a_val_stream_is_not_checked_and_its_evaluation_counts_every_item(made):
    again = fit(task(Stream(one_pass=False)))
    once = fit(task(made()))
    assert once.val_loss == again.val_loss


def test_the_check_is_left_out_where_the_run_evaluates_after_its_first_step(tmp_path):
    calls = [0]

    def counting(outputs, targets):
        calls[0] += 1
        return 0.0

    fit(task(val_set(), counting), max_steps=1)  # its final evaluation follows at once: 2 batches of 8 (12 items)
    assert calls[0] == 2
    calls[0] = 0
    fit(task(val_set(), counting), max_steps=2, eval_every=1)  # evaluated at steps 1 and 2
    assert calls[0] == 4
