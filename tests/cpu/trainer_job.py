"""A training job the resume tests run in a subprocess, and kill.

    python trainer_job.py OUT STEPS [--resume] [--kill-at-step N] [--kill-in-checkpoint N] [--sleep S]

Trains a small model with dropout (so RNG state matters) for STEPS steps with a checkpoint every
3 steps. --kill-at-step sends SIGKILL to itself right after step N; --kill-in-checkpoint while
the checkpoint of step N is being committed (its files written, not yet renamed into place).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.checkpoint import layout as ckpt
from redline.train.callbacks import Callback
from redline.train.trainer import Trainer


def make_task() -> redline.Task:
    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(200, 12, generator=gen), torch.randint(0, 3, (200,), generator=gen))
    val = TensorDataset(torch.randn(40, 12, generator=gen), torch.randint(0, 3, (40,), generator=gen))
    return redline.Task(
        model=lambda: nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)),
        loss_fn=nn.functional.cross_entropy,
        train_data=data,
        val_data=val,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5)),
        batch_size=16,  # 13 batches an epoch: checkpoints fall mid-epoch
        epochs=100,
        name="job",
    )


class KillAt(Callback):
    def __init__(self, step: int, sleep: float) -> None:
        self.step, self.sleep = step, sleep

    def on_step(self, trainer: Trainer, step: int, loss: float) -> None:
        if self.sleep:
            time.sleep(self.sleep)
        if step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_in_checkpoint(step: int) -> None:
    real_commit = ckpt.commit_directory

    def commit(tmp, final):  # type: ignore[no-untyped-def]
        if final.name == f"{ckpt.PREFIX}{step:08d}":
            os.kill(os.getpid(), signal.SIGKILL)
        real_commit(tmp, final)

    ckpt.commit_directory = commit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at-step", type=int, default=0)
    parser.add_argument("--kill-in-checkpoint", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kill_in_checkpoint:
        kill_in_checkpoint(args.kill_in_checkpoint)
    callbacks = [KillAt(args.kill_at_step, args.sleep)] if (args.kill_at_step or args.sleep) else []
    trainer = Trainer(
        make_task(),
        runtime=redline.RuntimeOptions(devices="cpu", seed=3),
        max_steps=args.steps,
        checkpoint_every=3,
        eval_every=5,
        log_every=1,
        out_dir=args.out,
        progress=False,
        callbacks=callbacks,
        resume="auto" if args.resume else None,
    )
    summary = trainer.fit()
    print(f"done steps={summary.steps} stopped={summary.stopped}", flush=True)


if __name__ == "__main__":
    main()
