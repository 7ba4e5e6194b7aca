"""A step that fails is put back to its start before the steps so far are checkpointed: what its forward drew
(dropout's masks, an augmentation's) and moved (batch norms' running statistics) is not saved with them, so the run
resumed once the cause is gone equals the unbroken run, bitwise on CPU."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import redline
from redline.errors import TrainingError
from redline.runtime.loading import gathered
from redline.train.step_start import draws_here
from redline.train.trainer import Trainer


class Augmented(Dataset):
    """Rows with noise drawn from torch's global stream (or NumPy's) as each is read (an augmentation in the main
    process)."""

    def __init__(self, data: TensorDataset, numpy: bool = False) -> None:
        self.data, self.numpy = data, numpy

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        noise = torch.from_numpy(np.random.normal(size=x.shape)).float() if self.numpy else torch.randn(x.shape)
        return x + 0.1 * noise, y


def task(
    *,
    fail_at: int = 0,
    dropout: float = 0.0,
    norm: bool = False,
    nan_row: int | None = None,
    augment: bool = False,
    numpy: bool = False,
) -> redline.Task:
    """64 samples in batches of 8. The loss raises at its ``fail_at``-th training call, and on a non-finite value
    (where row ``nan_row`` is NaN: a bad record)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=gen), torch.randint(0, 2, (64,), generator=gen)
    if nan_row is not None:
        x[nan_row] = math.nan
    data = TensorDataset(x, y)
    calls = [0]

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not outputs.is_meta:  # not the FLOP count's meta copy
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("a cosmic ray")
        value = nn.functional.cross_entropy(outputs, targets)
        if not torch.isfinite(value):
            raise ValueError("non-finite loss: a bad batch")
        return value

    def model() -> nn.Module:
        norms = [nn.BatchNorm1d(16)] if norm else []
        return nn.Sequential(nn.Linear(6, 16), *norms, nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 2))

    return redline.Task(
        model=model, loss_fn=loss, train_data=Augmented(data, numpy) if augment else data, batch_size=8, epochs=2,
        val_data=TensorDataset(torch.randn(16, 6, generator=gen), torch.randint(0, 2, (16,), generator=gen)),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    )  # fmt: skip


def fit(task: redline.Task, out: Path, grad_accum: int = 1, **kwargs: object) -> redline.TrainSummary:
    options = redline.RuntimeOptions(
        devices="cpu", seed=0, precision="fp32", compile="off", grad_accum=grad_accum, loader_workers=0
    )
    with Trainer(task, runtime=options, progress=False, out_dir=out, trial="off", **kwargs) as trainer:
        return trainer.fit()


def same_weights(a: Path, b: Path) -> None:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


@pytest.mark.parametrize(
    ("kind", "grad_accum", "fail_at"),
    [
        ({"dropout": 0.5}, 1, 4),  # step 4's forward drew its masks: resumed, step 4 drew the next ones
        ({"norm": True}, 1, 4),  # step 4's batch moved the statistics: resumed, they moved twice
        ({"norm": True}, 2, 7),  # step 4's first micro-batch (only a later one's were put back)
        ({"norm": True, "dropout": 0.5}, 2, 8),  # step 4's second: its statistics were, its masks were not
        ({"augment": True}, 1, 4),  # step 4's batch drew its noise as it was read
        ({"augment": True, "numpy": True}, 1, 4),  # from NumPy's stream, kept where this process reads the items
    ],
)
def test_a_run_failing_inside_a_step_resumes_into_the_unbroken_run(
    tmp_path: Path, kind: dict[str, object], grad_accum: int, fail_at: int
) -> None:
    fit(task(**kind), tmp_path / "unbroken", grad_accum)  # type: ignore[arg-type]
    with pytest.raises(TrainingError, match=r"(?s)a cosmic ray.*saved in .*step-00000003"):
        fit(task(fail_at=fail_at, **kind), tmp_path / "broken", grad_accum)  # type: ignore[arg-type]
    fit(task(**kind), tmp_path / "broken", grad_accum, resume="auto")  # type: ignore[arg-type]
    same_weights(tmp_path / "unbroken", tmp_path / "broken")


def test_a_nan_batch_does_not_poison_the_checkpoint_of_the_steps_before_it(tmp_path: Path) -> None:
    # Its forward made the running mean NaN, and the checkpoint kept it: resumed on clean data, every evaluation's
    # loss was NaN ("evaluation at step 8: ... non-finite loss")
    with pytest.raises(TrainingError, match=r"(?s)non-finite loss.*saved in") as failed:
        fit(task(norm=True, nan_row=5), tmp_path / "broken", log_every=1)
    (kept,) = (tmp_path / "broken" / "checkpoints").glob("step-*")
    assert str(kept) in str(failed.value)
    assert all(t.isfinite().all() for t in load_file(kept / "model.safetensors").values())
    fit(task(norm=True), tmp_path / "broken", resume="auto")  # the bad record fixed
    fit(task(norm=True), tmp_path / "unbroken")
    same_weights(tmp_path / "unbroken", tmp_path / "broken")


def test_pythons_and_numpys_streams_are_kept_only_where_this_process_reads_the_items_through_the_datasets_code():
    # reading them costs 30 us a step: kept where an augmentation or a collate_fn may draw here
    data = TensorDataset(torch.zeros(8, 2), torch.zeros(8))
    whole, collate = gathered(data, None)  # an in-memory set is gathered whole: no item code runs
    assert not draws_here(torch.utils.data.DataLoader(whole, batch_size=4, collate_fn=collate))
    assert draws_here(torch.utils.data.DataLoader(Augmented(data), batch_size=4))
    assert not draws_here(torch.utils.data.DataLoader(Augmented(data), batch_size=4, num_workers=1))
