"""One training loop alone in its process, for whole-process comparisons (``farm-bench --vs``): the naive loop
with ``zero_grad()`` before the forward (the tutorial's) or before the backward, or the same steps through a
Runtime at fp32, eager, with its loader.

Loops taking turns in one process share its memory allocator, and each one's frees and allocations move the
others' page faults: on a 2-core Xeon the naive loop's order ran chargpt 3-5% faster than the Runtime's in one
process, and 1.047x slower as a process of its own (benchmarks/results/bench-cpu-xeon-amx.md).

    farm-bench -n 6 --vs 'python benchmarks/one_loop.py naive example:chargpt 250' -- \\
        python benchmarks/one_loop.py runtime example:chargpt 250
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import torch

import redline
from redline.bench.loops import _loader
from redline.task.spec import load_task

LOOPS = ("naive", "naive-zero-before-backward", "runtime")


def batches(loader: Any, steps: int) -> Iterator[Any]:
    """``steps`` batches of ``loader``, starting it again when it runs out."""
    done = 0
    while done < steps:
        for batch in loader:
            if done == steps:
                return
            done += 1
            yield batch


def naive(task: redline.Task, steps: int, *, zero_before_backward: bool) -> None:
    torch.manual_seed(0)
    model = task.build_model()
    model.train()
    optimizer = task.optimizer(model.parameters())
    for inputs, targets in batches(_loader(task, task.batch_size, 0), steps):
        if not zero_before_backward:
            optimizer.zero_grad()
        loss = task.loss_fn(model(inputs), targets)
        if zero_before_backward:
            optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def runtime(task: redline.Task, steps: int) -> None:
    with redline.Runtime(devices="cpu", precision="fp32", compile="off", cuda_graphs="off") as rt:
        torch.manual_seed(0)
        model, optimizer = rt.setup(task.build_model(), task.optimizer)
        model.train()
        for inputs, targets in batches(rt.setup_loader(_loader(task, task.batch_size, 0)), steps):
            with rt.autocast():
                loss = task.loss_fn(model(inputs), targets)
            rt.backward(loss)
            rt.step(optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loop", choices=LOOPS)
    parser.add_argument("task")
    parser.add_argument("steps", type=int)
    args = parser.parse_args()
    task = load_task(args.task)
    run: Callable[[], None] = {
        "naive": lambda: naive(task, args.steps, zero_before_backward=False),
        "naive-zero-before-backward": lambda: naive(task, args.steps, zero_before_backward=True),
        "runtime": lambda: runtime(task, args.steps),
    }[args.loop]
    run()


if __name__ == "__main__":
    main()
