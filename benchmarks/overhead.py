"""Runtime loop vs plain PyTorch loop: steady-state step time side by side, in one process.

Both loops train the same model on the same DataLoader; many short rounds alternate which loop
goes first, so drift of a noisy machine falls on both. The figures are the ratio of median step
times and the median of per-round ratios (Runtime / plain); goal <= 1.01. Two workloads: a tiny
MLP, where the loop's own overhead is largest relative to the step, and the digits CNN.

    python benchmarks/overhead.py [--tasks tiny,example:digits] [--rounds 100] [--steps 20] [--threads N]
                                  [--write NAME]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import environment
import redline


def plain_stepper(task: redline.Task, device: torch.device) -> Callable[[int], float]:
    torch.manual_seed(0)
    model = task.build_model().to(device)
    optimizer = task.optimizer(model.parameters())
    batches = _forever(DataLoader(task.train_data, batch_size=task.batch_size, shuffle=True, drop_last=True))

    def run(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            inputs, targets = next(batches)
            inputs, targets = inputs.to(device), targets.to(device)
            loss = task.loss_fn(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        _sync(device)
        return (time.perf_counter() - start) / steps

    return run


def runtime_stepper(task: redline.Task, device: torch.device) -> Callable[[int], float]:
    torch.manual_seed(0)
    rt = redline.Runtime(devices=str(device), precision="fp32", compile="off")
    model, optimizer = rt.setup(task.build_model(), task.optimizer)
    loader = DataLoader(task.train_data, batch_size=task.batch_size, shuffle=True, drop_last=True)
    batches = _forever(rt.setup_loader(loader))

    def run(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            inputs, targets = next(batches)
            with rt.autocast():
                loss = task.loss_fn(model(inputs), targets)
            rt.backward(loss)
            rt.step(optimizer)
        _sync(device)
        return (time.perf_counter() - start) / steps

    return run


def _forever(loader: object) -> Iterator[object]:
    return itertools.chain.from_iterable(itertools.repeat(loader))  # type: ignore[arg-type]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tiny_task() -> redline.Task:
    """A two-layer MLP whose step takes well under a millisecond, so loop overhead shows."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 64, generator=gen), torch.randint(0, 10, (4096,), generator=gen))
    return redline.Task(
        model=lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)),
        loss_fn=nn.functional.cross_entropy,
        train_data=data,
        batch_size=64,
        name="tiny-mlp",
    )


def measure(task: redline.Task, device: torch.device, rounds: int, steps: int) -> dict[str, list[float]]:
    """Return per-round mean step times of both loops and their per-round ratios."""
    loops = {"plain": plain_stepper(task, device), "runtime": runtime_stepper(task, device)}
    for run in loops.values():  # warm-up: allocator, kernels, first batches
        run(steps * 3)
    times: dict[str, list[float]] = {"plain": [], "runtime": [], "ratio": []}
    for i in range(rounds):
        order = ["plain", "runtime"] if i % 2 == 0 else ["runtime", "plain"]
        got = {name: loops[name](steps) for name in order}
        for name, value in got.items():
            times[name].append(value)
        times["ratio"].append(got["runtime"] / got["plain"])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="tiny,example:digits", help="comma-separated: tiny or a task spec")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20, help="steps per loop per round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (fewer: less noise)")
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    med = environment.median
    body = [
        f"{args.rounds} rounds of {args.steps} steps per loop, alternating which loop runs first; "
        "fp32, compile off for both. Per-round ratio = Runtime step time / plain step time.",
        "",
        "| workload | batch | plain median step (ms) | Runtime median step (ms) | ratio of medians "
        "| median per-round ratio | per-round ratio min-max |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for spec in args.tasks.split(","):
        task = tiny_task() if spec == "tiny" else redline.load_task(spec)
        t = measure(task, device, args.rounds, args.steps)
        body.append(
            f"| {task.name} | {task.batch_size} | {med(t['plain']) * 1e3:.3f} | {med(t['runtime']) * 1e3:.3f} "
            f"| **{med(t['runtime']) / med(t['plain']):.4f}** | **{med(t['ratio']):.4f}** "
            f"| {min(t['ratio']):.3f}-{max(t['ratio']):.3f} |"
        )
        print(body[-1], flush=True)
    body += ["", "Goal: Runtime / plain <= 1.01."]
    environment.publish(args.write, "Runtime overhead vs the plain loop", body, args.device)


if __name__ == "__main__":
    main()
