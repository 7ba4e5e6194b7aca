"""How far a precision trial's first round predicts its last: the evidence for deciding after one round.

auto's precision trial (runtime/trial.py) times fp32 and each candidate in rotating rounds of three
timed steps. It may stop early where the rounds left could hardly change the choice. This script runs
whole trials (every round, ``stop_early=False``) on workloads whose candidate leads differ (bf16 far
ahead, a little ahead, behind), ``--trials`` times each in one process (the process's first trial
included: a real run's one trial is its first), and reports each trial's lead over fp32 (fp32's fastest
step over the candidate's) after its first round, its second, and all of them, and what each would choose.

    python benchmarks/trial_rounds.py [--trials 8] [--write NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

import environment
from redline.hardware.device import probe_device
from redline.plan.layout import has_conv2d, resolve_channels_last
from redline.plan.precision import fast_precisions
from redline.runtime import trial
from redline.runtime.contract import split_batch
from redline.runtime.loading import read_batches
from redline.task.spec import load_task

# (spec, options): bf16 far ahead (digits), a wider digits, and GPTs where bf16 loses (the default chargpt) or wins
WORKLOADS: list[tuple[str, dict[str, Any]]] = [
    ("example:digits", {}),
    ("example:digits", {"width": 64}),
    ("example:digits", {"batch_size": 16}),
    ("example:chargpt", {}),
    ("example:chargpt", {"n_layer": 4, "n_embd": 256}),
    ("example:chargpt", {"n_embd": 192, "batch_size": 16}),
]


def leads(measured: list[trial.Measured], rounds: int) -> list[float]:
    """Each candidate's lead over fp32 after ``rounds`` rounds: fp32's fastest step over the candidate's."""
    fp32, *others = measured
    shown = rounds * trial.BLOCK
    return [min(fp32.step_times[:shown]) / min(m.step_times[:shown]) for m in others if m.step_times]


def early(measured: list[trial.Measured], decisive: float) -> tuple[int, str]:
    """The rounds a trial with early decisions (a winner after one round from a lead of ``decisive``) would have run
    on these steps, and what it would have chosen."""
    for rounds in range(1, trial.ROUNDS + 1):
        shown = [dataclasses.replace(m, step_times=m.step_times[: rounds * trial.BLOCK]) for m in measured]
        if trial.decided([list(m.step_times) for m in shown], rounds, decisive=decisive):
            break
    return rounds, trial.choose(shown, "this CPU").value


def whole_trials(spec: str, options: dict[str, Any], count: int) -> list[list[trial.Measured]]:
    """``count`` trials of every round on the task's first batch, as `redline train` would lay it out."""
    task = load_task(spec, **options)
    device = torch.device("cpu")
    facts = probe_device(device)
    model = task.build_model()
    loader = DataLoader(task.train_data, batch_size=task.batch_size, collate_fn=task.collate_fn)
    batch = split_batch(next(read_batches(loader)), "train_data")
    convolutional = has_conv2d(model)

    def layout(precision: str) -> bool:
        return resolve_channels_last("auto", facts, has_conv2d=convolutional, precision=precision).value

    candidates = fast_precisions(facts)
    return [
        trial.run_trial(model, task.optimizer, task.loss_fn, batch, device, candidates, stop_early=False, layout=layout)
        for _ in range(count)
    ]


def span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x" if values else "n/a"


def counted(rounds: list[int]) -> str:
    """How many trials ran each number of rounds: "2 x9, 1 x1"."""
    return ", ".join(f"{r} x{rounds.count(r)}" for r in sorted(set(rounds)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    environment.exit_without_cpu_trials()
    body = [
        f"`python benchmarks/trial_rounds.py --trials {args.trials}`. Each workload's trial runs whole "
        f"({trial.ROUNDS} rounds of {trial.BLOCK} timed steps per candidate, after a settling step each) "
        f"{args.trials} times in one process, its first trial included. A lead is fp32's fastest step over the "
        "candidate's; after round 1 it rests on 3 timed steps each, after all rounds on "
        f"{trial.TIMED_STEPS}. `last / first` is how far the rounds after the first moved each trial's lead. "
        "The last columns replay each trial's steps under the early decisions, without a winner after one round "
        f"and with one from a lead of {trial.DECISIVE}x (DECISIVE): the rounds they would have run, and how often "
        "they chose what every round chose.",
        "",
        "| workload | lead after round 1 | after round 2 | after every round | last / first | "
        f"chosen by every round (>= {trial.MARGIN}x) | no winner after one: rounds, same choice | "
        "a winner after one: rounds, same choice |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    moved: list[float] = []
    for spec, options in WORKLOADS:
        began = time.perf_counter()
        trials = whole_trials(spec, options, args.trials)
        first = [lead for t in trials for lead in leads(t, 1)]
        second = [lead for t in trials for lead in leads(t, 2)]
        last = [lead for t in trials for lead in leads(t, trial.ROUNDS)]
        ratios = [b / a for a, b in zip(first, last, strict=True)]
        moved += ratios
        chosen = [trial.choose(t, "this CPU").value for t in trials]
        told = ", ".join(f"{name} x{chosen.count(name)}" for name in dict.fromkeys(chosen))
        name = spec + "".join(f" {k}={v}" for k, v in options.items())
        row = f"| `{name}` | {span(first)} | {span(second)} | {span(last)} | {span(ratios)} | {told} "
        for decisive in (math.inf, trial.DECISIVE):
            decisions = [early(t, decisive) for t in trials]
            same = sum(choice == whole for (_, choice), whole in zip(decisions, chosen, strict=True))
            row += f"| {counted([r for r, _ in decisions])}; {same} of {len(trials)} "
        body.append(row + "|")
        print(f"{name}: {time.perf_counter() - began:.1f} s; round 1 {[round(x, 2) for x in first]}", flush=True)
        print(f"  every round {[round(x, 2) for x in last]}", flush=True)
    body += ["", f"Over every workload, the rounds after the first moved a lead by {span(moved)}."]
    environment.publish(args.write, "How far a precision trial's first round predicts its last", body)


if __name__ == "__main__":
    main()
