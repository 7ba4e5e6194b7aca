"""A training step with each attention kernel that takes the model's calls, against torch's own pick, side by side.

For each task (a spec with its options, ``example:chargpt`` or ``example:chargpt?block_size=256``), the model's
calls to ``F.scaled_dot_product_attention`` are recorded on two samples, and for each precision the device runs
fast (fp32 too), every kernel that takes all of them (runtime/attention.py) trains its own copy of the model (same
seed) on one real batch, preferred for its steps as `--attention KERNEL` prefers it; "auto" is torch's pick. The
entries take turns in rotating rounds (a settling step, then ``--block`` timed steps each) after a warm-up; the
figure per entry is its fastest block's mean step, and the ratio is against "auto" in the same precision, measured in
the same rounds. This is the measurement behind the attention axis of `redline tune`.

    python benchmarks/attention_speed.py [--device cpu] [--tasks example:chargpt] [--rounds 6] [--block 5]
                                         [--write NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

import environment
from layout_speed import window
from redline.bench.tune import model_attention
from redline.hardware.device import probe_device
from redline.plan.precision import fast_precisions
from redline.runtime.attention import kernels_taking, prefer_kernel
from redline.runtime.contract import split_batch
from redline.runtime.loading import read_batches
from redline.runtime.precision import AUTOCAST_DTYPES, Precision
from redline.runtime.transfer import device_sync, move_to
from redline.runtime.trial import time_steps
from redline.task.spec import load_task


def task_of(spec: str) -> Any:
    """``example:chargpt?block_size=256&n_layer=4``: the spec, with integer options after the ``?``."""
    name, _, query = spec.partition("?")
    options = dict(part.split("=") for part in query.split("&")) if query else {}
    return load_task(name, **{key: int(value) for key, value in options.items()})


def step_of(task: Any, batch: Any, device: torch.device, precision: str, kernel: str) -> Callable[[], float]:
    torch.manual_seed(0)
    model = task.build_model().to(device).train()
    inputs, targets = move_to(batch, device)
    optimizer = task.optimizer(model.parameters())
    applied = Precision(precision, device)  # type: ignore[arg-type]

    def step() -> float:
        with prefer_kernel(kernel) if kernel != "auto" else contextlib.nullcontext():
            optimizer.zero_grad(set_to_none=True)
            with applied.autocast():
                loss = task.loss_fn(model(inputs), targets)
            applied.backward(loss)
            applied.step(optimizer, None)
        return float(loss.detach())

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tasks", default="example:chargpt")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    device = torch.device(args.device)
    facts = probe_device(device)
    body = [
        f"`python benchmarks/attention_speed.py --device {args.device} --tasks {args.tasks} --rounds {args.rounds} "
        f"--block {args.block}`: per entry, its fastest of {args.rounds} blocks of {args.block} steps (mean step of "
        "a block), entries taking turns in rotating rounds; ratios against torch's own pick (auto) in the same "
        "precision, from the same rounds.",
        "",
        "| task | precision | attention | step ms | vs auto | loss after the steps |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for spec in args.tasks.split(","):
        task = task_of(spec)
        calls = model_attention(task, args.device)
        loader = DataLoader(task.train_data, batch_size=task.batch_size, collate_fn=task.collate_fn)
        batch = split_batch(next(read_batches(loader)), "train_data")
        entries = [
            (precision, kernel)
            for precision in ["fp32", *fast_precisions(facts)]
            for kernel in ["auto", *kernels_taking(calls, device, AUTOCAST_DTYPES.get(precision))]
        ]
        steps = [step_of(task, batch, device, precision, kernel) for precision, kernel in entries]
        for step in steps:
            for _ in range(2):  # warm-up: first kernels, allocations
                step()
        windows = [functools.partial(window, step, args.block) for step in steps]
        times, losses = time_steps(
            windows, warmup=0, rounds=args.rounds, block=1, settle=steps, sync=device_sync(device)
        )
        best = [min(timed) / args.block for timed in times]
        for (precision, kernel), step_s, loss in zip(entries, best, losses, strict=True):
            auto = best[entries.index((precision, "auto"))]
            body.append(
                f"| {spec} | {precision} | {kernel} | {step_s * 1e3:.2f} | **{auto / step_s:.3f}x** | {loss[-1]:.4f} |"
            )
        print("\n".join(body[-len(entries) :]), flush=True)
        if not calls:
            body.append(f"| {spec} | | | | the model calls no scaled_dot_product_attention | |")
    text = "\n".join(["# Attention kernels against torch's own pick", "", *environment.describe(args.device), "",
                      *body, ""])  # fmt: skip
    print(text)
    if args.write:
        path = environment.RESULTS / f"{args.write}.md"
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
