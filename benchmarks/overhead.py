"""Runtime loop vs plain PyTorch loop: steady-state step time side by side, in one process.

Both loops train the same model on the same DataLoader; rounds alternate which loop goes first,
so drift of a noisy machine falls on both. The figure is the ratio of median step times
(Runtime / plain); goal <= 1.01.

    python benchmarks/overhead.py [--task example:digits] [--rounds 15] [--steps 40] [--write NAME]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="example:digits")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40, help="steps per loop per round")
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()

    task = redline.load_task(args.task)
    device = torch.device(args.device)
    loops = {"plain": plain_stepper(task, device), "runtime": runtime_stepper(task, device)}
    for run in loops.values():  # warm-up: allocator, kernels, first batches
        run(args.steps)
    times: dict[str, list[float]] = {"plain": [], "runtime": []}
    ratios = []
    for i in range(args.rounds):
        order = ["plain", "runtime"] if i % 2 == 0 else ["runtime", "plain"]
        got = {name: loops[name](args.steps) for name in order}
        for name, value in got.items():
            times[name].append(value)
        ratios.append(got["runtime"] / got["plain"])
    plain, runtime = environment.median(times["plain"]), environment.median(times["runtime"])
    body = [
        f"Task `{args.task}`, batch {task.batch_size}, {args.rounds} rounds of {args.steps} steps per loop, "
        "alternating which loop runs first; fp32, compile off for both.",
        "",
        "| loop | median step (ms) | min | max |",
        "| --- | --- | --- | --- |",
        *(
            f"| {name} | {environment.median(v) * 1e3:.3f} | {min(v) * 1e3:.3f} | {max(v) * 1e3:.3f} |"
            for name, v in times.items()
        ),
        "",
        f"**Runtime / plain, ratio of medians: {runtime / plain:.4f}**; "
        f"median of per-round ratios {environment.median(ratios):.4f} "
        f"(min {min(ratios):.4f}, max {max(ratios):.4f}). Goal: <= 1.01.",
    ]
    print("\n".join(body))
    if args.write:
        print(f"wrote {environment.write(args.write, 'Runtime overhead vs the plain loop', body, args.device)}")


if __name__ == "__main__":
    main()
