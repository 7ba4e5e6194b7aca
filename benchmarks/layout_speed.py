"""A training step in NCHW and in channels_last (NHWC), under fp32 and bf16 autocast, side by side on this CPU.

For each task, four copies of the model (same seed) train on one real batch: fp32 and bf16-mixed, each
in both layouts. They take turns in rotating rounds (a settling step, then ``--block`` timed steps
each), after a warm-up; the figure per entry is its fastest step, and the ratio is against fp32 in NCHW
measured in the same rounds. This is the measurement behind channels_last's auto rule on CPUs
(plan/layout.py).

    python benchmarks/layout_speed.py [--tasks example:digits] [--rounds 8] [--block 10] [--write NAME]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

import environment
from redline.runtime.contract import split_batch
from redline.runtime.loading import read_batches
from redline.runtime.trial import time_steps
from redline.task.spec import load_task


def step_of(task: Any, batch: tuple[Any, Any], bf16: bool, channels_last: bool) -> Callable[[], float]:
    torch.manual_seed(0)
    model, (inputs, targets) = task.build_model(), batch
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    optimizer = task.optimizer(model.parameters())

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = task.loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def window(step: Callable[[], float], steps: int) -> float:
    """``steps`` training steps in a row, timed as one; the last loss."""
    return [step() for _ in range(steps)][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="example:digits")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    body = [
        f"`python benchmarks/layout_speed.py --tasks {args.tasks} --rounds {args.rounds} --block {args.block}`: "
        f"per entry, its fastest of {args.rounds} blocks of {args.block} steps (mean step of a block), entries "
        "taking turns in rotating rounds; ratios against fp32 in NCHW from the same rounds.",
        "",
        "| task | precision | layout | step ms | vs fp32 NCHW |",
        "| --- | --- | --- | --- | --- |",
    ]
    for spec in args.tasks.split(","):
        task = load_task(spec)
        loader = DataLoader(task.train_data, batch_size=task.batch_size, collate_fn=task.collate_fn)
        batch = split_batch(next(read_batches(loader)), "train_data")
        entries = [(bf16, laid) for bf16 in (False, True) for laid in (False, True)]
        steps = [step_of(task, batch, bf16, laid) for bf16, laid in entries]
        for step in steps:
            for _ in range(3):  # warm-up: first kernels, allocations
                step()
        # the trial's own timing: rotating rounds of a settling step and one timed window of --block steps each
        windows = [functools.partial(window, step, args.block) for step in steps]
        times, _ = time_steps(windows, warmup=0, rounds=args.rounds, block=1, settle=steps)
        best = [min(timed) / args.block for timed in times]
        for (bf16, laid), seconds in zip(entries, best, strict=True):
            body.append(
                f"| `{spec}` | {'bf16-mixed' if bf16 else 'fp32'} | {'channels_last' if laid else 'NCHW'} | "
                f"{seconds * 1e3:.2f} | {best[0] / seconds:.2f}x |"
            )
    environment.publish(args.write, "Training steps in NCHW and channels_last", body)


if __name__ == "__main__":
    main()
