"""A job test_dist_evaluation.py starts under `redline launch --nproc 2`: FSDP with BatchNorm, evaluated on shards
of unequal length, and a sharded checkpoint's BatchNorm statistics.

    python eval_ranks_job.py OUT

Writes OUT/rank{R}.json: the sizes of the model's evaluation forwards, the Trainer's metrics, rank 0's whole model
evaluated in one process on all of val_data (the reference: rank 0's alone holds it), an evaluation where rank 0's
share is empty, one of a stream whose shares differ in batches, and a Runtime's BatchNorm running mean before a
sharded save and after loading it back.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch._dynamo  # imported before the hang watchdog starts: see dist_job.py
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import redline
from redline.train.evaluation import evaluate_model
from redline.train.trainer import Trainer

RANK = int(os.environ.get("RANK", "0"))
BATCH = 8  # the global batch: 4 a rank
EVAL_SIZES: list[int] = []  # the batch size of each evaluation forward on this rank


class Net(nn.Module):
    def __init__(self, record: bool = True) -> None:
        super().__init__()
        self.record = record
        self.layers = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.record and not self.training and not x.is_meta:
            EVAL_SIZES.append(len(x))
        return self.layers(x)


class Stream(IterableDataset):
    """The first ``n`` samples of a TensorDataset as a stream, each rank dealt every other one."""

    def __init__(self, data: TensorDataset, n: int) -> None:
        self.data, self.n = data, n

    def __iter__(self):
        return (self.data[i] for i in range(self.n))


def make_task() -> redline.Task:
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 6, generator=gen) * 3 + 1, torch.randint(0, 3, (64,), generator=gen)
    # 9 samples: rank 0 takes 4 (one batch of 4), rank 1 takes 5 (two batches: 4 and 1)
    return redline.Task(
        model=Net, loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(x[:55], y[:55]),
        val_data=TensorDataset(x[55:], y[55:]), optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        batch_size=BATCH, name="eval-ranks",
    )  # fmt: skip


def whole_model_losses(trainer: Trainer, task: redline.Task) -> tuple[float, float, float]:
    """Rank 0's weights and buffers, evaluated in one process on every sample of val_data, on its first alone, and
    on its first 5 (collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(trainer.model, options=options)  # buffers: each rank's own
    plain = Net(record=False).eval()
    if RANK == 0:
        plain.load_state_dict(state)
    x, y = task.val_data.tensors  # type: ignore[union-attr]
    with torch.no_grad():
        losses = nn.functional.cross_entropy(plain(x), y, reduction="none")
    return losses.mean().item(), losses[0].item(), losses[:5].mean().item()


def checkpoint_running_mean(out: Path) -> dict[str, list[float]]:
    """Rank 0's BatchNorm running mean after ranks trained on different data, before a save and after its load."""
    gen = torch.Generator().manual_seed(10 + RANK)  # each rank's own data: their statistics differ
    x, y = torch.randn(40, 6, generator=gen) * (1 + RANK), torch.randint(0, 3, (40,), generator=gen)
    model = Net()
    with redline.Runtime(devices="cpu", seed=0, strategy="fsdp", precision="fp32") as rt:
        model, opt = rt.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=10):
            rt.backward(nn.functional.cross_entropy(model(xb), yb))
            rt.step(opt)
        before = rt.unwrap(model).layers[1].running_mean.tolist()
        rt.save(out / "sharded")
        rt.load(out / "sharded")
        return {"before": before, "after": rt.unwrap(model).layers[1].running_mean.tolist()}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    task = make_task()
    runtime = redline.RuntimeOptions(devices="cpu", seed=5, strategy="fsdp", precision="fp32")
    trainer = Trainer(task, runtime=runtime, max_steps=4, eval_every=2, log_every=1, progress=False)
    with trainer:
        summary = trainer.fit()  # evaluations at steps 2 and 4, then the final one
        assert trainer.rt is not None and trainer.model is not None
        metrics = trainer.evaluate()
        forwards = len(EVAL_SIZES)
        reference, first, first_5 = whole_model_losses(trainer, task)
        x, y = task.val_data.tensors  # type: ignore[union-attr]
        one_sample = replace(task, val_data=TensorDataset(x[:1], y[:1]))  # rank 0's share: none
        alone = evaluate_model(one_sample, trainer.model, trainer.rt, BATCH // 2, trainer.env)
        one_sample_forwards = len(EVAL_SIZES) - forwards
        # a stream of 5 in batches of 2: rank 0's 3 samples are two batches, rank 1's 2 one
        stream = replace(task, val_data=Stream(task.val_data, 5))  # type: ignore[arg-type]
        streamed = evaluate_model(stream, trainer.model, trainer.rt, 2, trainer.env)
        result = {
            "eval_sizes": EVAL_SIZES[:forwards], "val_loss": metrics["val_loss"], "summary_val_loss": summary.val_loss,
            "reference": reference, "one_sample_forwards": one_sample_forwards,
            "one_sample_val_loss": alone["val_loss"], "first_reference": first,
            "stream_forwards": len(EVAL_SIZES) - forwards - one_sample_forwards,
            "stream_val_loss": streamed["val_loss"],
            "first_5_reference": first_5, "bn": checkpoint_running_mean(out),
        }  # fmt: skip
    (out / f"rank{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
