"""Whether a kernel picked by timing the model's attention calls alone is the one whole training steps pick.

A run too short to repay a trial of every attention kernel in whole steps has its trial time the model's
attention calls alone on each kernel first (runtime/measure.py ``picked_forms``), then each precision in whole
steps on that kernel only. This script checks that shortcut against the long way, on GPT workloads of several
shapes: per trial, it picks the kernel from the calls, as a run does, then runs the whole trial of every form in
whole steps (every round, ``stop_early=False``), and compares the two: the kernel each picks for bf16-mixed, and
the final choice of a trial of fp32 and the picked form (its steps taken from the same whole trial) against the
choice of the whole trial.

    python benchmarks/kernel_pick.py [--trials 5] [--write NAME]
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

import environment
from redline.parallel.env import DistEnv
from redline.runtime import trial
from redline.runtime.attention import model_attention
from redline.runtime.contract import split_batch
from redline.runtime.loading import read_batches
from redline.runtime.options import RuntimeOptions
from redline.runtime.workload import workload
from redline.task.spec import load_task

WORKLOADS: list[tuple[str, dict[str, Any]]] = [
    ("example:chargpt", {}),
    ("example:chargpt", {"batch_size": 8}),
    ("example:chargpt", {"batch_size": 128}),
    ("example:chargpt", {"n_layer": 4, "n_embd": 256}),
    ("example:chargpt", {"n_embd": 192, "batch_size": 16}),
    ("example:chargpt", {"block_size": 512, "batch_size": 8}),  # long rows: the attention weights math keeps grow
]


def one(spec: str, options: dict[str, Any]) -> dict[str, Any]:
    """The kernel the calls pick, and what a whole trial of every form in whole steps finds, on the task's batch."""
    task = load_task(spec, **options)
    device = torch.device("cpu")
    loader = DataLoader(task.train_data, batch_size=task.batch_size, collate_fn=task.collate_fn)
    batch = split_batch(next(read_batches(loader)), "train_data")
    work = workload(task, RuntimeOptions(devices="cpu"), task.batch_size, DistEnv())
    assert work is not None
    calls = model_attention(task, device, batch[0])
    forms = work.kernel_forms(calls)
    began = time.perf_counter()
    (picked,), told = work.picked_forms(calls)
    pick_s = time.perf_counter() - began
    ratio = re.search(r"ran ([0-9.]+)x torch's pick", told)
    whole = trial.run_trial(
        task.build_model(), task.optimizer, task.loss_fn, batch, device, [*work.candidates, *forms], stop_early=False
    )
    by_name = {m.precision: m for m in whole}
    bf16 = [m for m in whole[1:] if not m.rejected]
    fastest = min(bf16, key=lambda m: m.step_s).precision
    reference = whole[0]
    return {
        "picked": picked,
        "calls_ratio": float(ratio.group(1)) if ratio else None,
        "pick_s": pick_s,
        "steps_ratio": {m.precision: by_name[work.candidates[0]].step_s / m.step_s for m in bf16},
        "fastest": fastest,
        "whole_choice": trial.choose(whole, "this CPU").value,
        "picked_choice": trial.choose([reference, by_name[picked]], "this CPU").value,
        "forms": forms,
    }


def span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x" if values else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    environment.exit_without_cpu_trials()
    body = [
        f"`python benchmarks/kernel_pick.py --trials {args.trials}`. Per trial: the kernel for bf16-mixed picked by "
        "timing the model's attention calls alone (`picked_forms`, as a run too short for whole steps on every "
        "kernel does; a kernel is taken where it ran the calls 1.1x faster than torch's pick), then a whole "
        f"trial ({trial.ROUNDS} rounds of {trial.BLOCK} timed steps) of fp32, bf16-mixed on torch's pick and "
        "bf16-mixed on each other kernel. `calls` is the picked kernel's lead over torch's pick on the calls; "
        "`steps` is bf16-mixed on the other kernel over bf16-mixed on torch's pick, in whole steps. `same kernel`: "
        "the pick is the form whole steps found fastest; `same choice`: a trial of fp32 and the picked form (its "
        "steps from the same whole trial) chooses what the whole trial chose.",
        "",
        "| workload | picked (trials) | calls: lead | steps: lead | timing the calls | same kernel | same choice "
        "| whole trial chose |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for spec, options in WORKLOADS:
        name = spec + "".join(f" {k}={v}" for k, v in options.items())
        runs = [one(spec, options) for _ in range(args.trials)]
        picked = [r["picked"] for r in runs]
        told = ", ".join(f"{p.removeprefix('bf16-mixed with ') or p} x{picked.count(p)}" for p in dict.fromkeys(picked))
        steps = [v for r in runs for k, v in r["steps_ratio"].items() if k != "bf16-mixed"]
        calls = [r["calls_ratio"] for r in runs if r["calls_ratio"] is not None]
        same_kernel = sum(r["picked"] == r["fastest"] for r in runs)
        same_choice = sum(r["picked_choice"] == r["whole_choice"] for r in runs)
        chose = [r["whole_choice"] for r in runs]
        chose_told = ", ".join(f"{c} x{chose.count(c)}" for c in dict.fromkeys(chose))
        pick_s = environment.median([r["pick_s"] for r in runs])
        body.append(
            f"| `{name}` | {told} | {span(calls)} | {span(steps)} | {pick_s:.2f} s | {same_kernel} of {len(runs)} "
            f"| {same_choice} of {len(runs)} | {chose_told} |"
        )
        print(body[-1], flush=True)
    environment.publish(args.write, "A kernel picked from the attention calls alone against whole steps", body)


if __name__ == "__main__":
    main()
