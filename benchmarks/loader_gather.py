"""Gathered batches of in-memory tensors against DataLoader's per-sample fetch, side by side.

For a TensorDataset under the default collation the Runtime's loader indexes each batch out of the
tensors at once (``gather=on`` in the Plan's loader line) instead of indexing every sample and
stacking them. Part 1 times whole epochs of loading alone: a plain DataLoader against the same
loader through ``rt.setup_loader``, in alternating rounds. Part 2 trains the digits task with the
Trainer, gathering on and off in alternating rounds (off by hiding the dataset's kind from the
resolver), and compares the summaries' samples/s.

    python benchmarks/loader_gather.py [--rounds 9] [--write NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import environment
import redline
from redline.runtime import runtime as runtime_module
from redline.runtime.loading import loader_facts

SHAPES = {  # name: (samples, sample shape, batch)
    "digits-like 1x8x8": (1438, (1, 8, 8), 64),
    "CIFAR-like 3x32x32": (20000, (3, 32, 32), 128),
    "tabular 32 features": (100000, (32,), 256),
}


def epoch_seconds(batches: Any) -> float:
    start = time.perf_counter()
    for _ in batches:
        pass
    return time.perf_counter() - start


def loading(rounds: int) -> list[str]:
    """Per data shape: the median epoch of each loader, and the median of the per-round ratios."""
    rows = []
    for name, (size, shape, batch) in SHAPES.items():
        data = TensorDataset(torch.randn(size, *shape), torch.randint(0, 10, (size,)))
        shuffled = {"shuffle": True, "batch_size": batch}
        plain = DataLoader(data, generator=torch.Generator().manual_seed(0), **shuffled)
        with redline.Runtime(devices="cpu", seed=0) as rt:
            loaders = {
                "plain": plain,
                "gathered": rt.setup_loader(DataLoader(data, generator=torch.Generator().manual_seed(0), **shuffled)),
            }
            times: dict[str, list[float]] = {"plain": [], "gathered": []}
            for i in range(rounds + 1):  # the first round warms both up
                for which in ["plain", "gathered"] if i % 2 == 0 else ["gathered", "plain"]:
                    seconds = epoch_seconds(loaders[which])
                    if i:
                        times[which].append(seconds)
        p, g = environment.median(times["plain"]), environment.median(times["gathered"])
        per_round = environment.median([a / b for a, b in zip(times["plain"], times["gathered"], strict=True)])
        rows.append(f"| {name}, batch {batch} | {p * 1e3:.2f} | {g * 1e3:.2f} | **{p / g:.2f}x** | {per_round:.2f}x |")
    return rows


def training(rounds: int) -> tuple[list[str], str]:
    task = redline.load_task("example:digits")
    rates: dict[str, list[float]] = {"off": [], "on": []}
    plan = ""

    def hidden(loader: Any, local_devices: int = 1) -> Any:
        return dataclasses.replace(loader_facts(loader, local_devices), gatherable=False)

    for i in range(rounds + 1):
        for which in ["off", "on"] if i % 2 == 0 else ["on", "off"]:
            if which == "off":
                runtime_module.loader_facts = hidden  # type: ignore[assignment]
            try:
                options = redline.RuntimeOptions(devices="cpu", precision="fp32", compile="off", seed=0)
                summary = redline.Trainer(task, runtime=options, max_epochs=2, progress=False, trial="off").fit()
            finally:
                runtime_module.loader_facts = loader_facts
            if which == "on":
                plan = str(summary.plan.loader.value) if summary.plan.loader else ""
            if i and summary.samples_per_s:
                rates[which].append(summary.samples_per_s)
    off, on = environment.median(rates["off"]), environment.median(rates["on"])
    per_round = environment.median([b / a for a, b in zip(rates["off"], rates["on"], strict=True)])
    row = f"| digits, batch {task.batch_size}, fp32 | {off:,.0f} | {on:,.0f} | **{on / off:.3f}x** | {per_round:.3f}x |"
    return [row], plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    load_rows = loading(args.rounds)
    train_rows, plan = training(max(3, args.rounds // 3))
    body = [
        f"Part 1: one epoch of loading alone (shuffled, in-process), median of {args.rounds} alternating rounds.",
        "",
        "| data | plain DataLoader (ms per epoch) | rt.setup_loader, gathered (ms per epoch) | speed-up "
        "(ratio of medians) | median per-round ratio |",
        "| --- | --- | --- | --- | --- |",
        *load_rows,
        "",
        f"Part 2: `redline.Trainer` on digits for 2 epochs, gathering off and on in alternating rounds "
        f"(median of {max(3, args.rounds // 3)} each); samples/s from the summary (training steps only). "
        f"The Plan's loader line with gathering on: `{plan}`.",
        "",
        "| run | samples/s, gather off | samples/s, gather on | ratio of medians | median per-round ratio |",
        "| --- | --- | --- | --- | --- |",
        *train_rows,
    ]
    environment.publish(args.write, "Gathered batches of in-memory tensors", body)


if __name__ == "__main__":
    main()
