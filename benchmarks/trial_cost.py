"""What auto's precision trial costs, in seconds and in the run's own fp32 steps, and what it chose.

For each task, the trial (runtime/trial.py ``run_trial``, as `redline train` runs it on the task's
first batch) runs with its early decisions (the default) and with every round, in alternating
order, ``--pairs`` times each after one uncounted trial that pays the process's first-use costs.
The figures are medians: the trial's wall time, that time in fp32 steps (the trial's own fastest
fp32 step), the timed steps per candidate, and the choice. A trial that finds nothing is a cost the
plain loop does not pay; one that finds a winner repays itself over the run.
The counted trials follow one in the same process, so they leave out the first-use costs a real
run's one trial pays (the first optimizer imports torch._dynamo, the first bf16 step builds its
kernels): each entry's first trial in a fresh process (empty caches, ``--firsts`` processes,
rotated like the rounds) is timed too, and its median reported beside them.
Each precision is timed in the layout the run gives it (plan/layout.py), where a version's trial
takes a layout.

``--baseline-src DIR`` times another version's trial.py too (DIR is that checkout's src/), in the
same rounds, so two versions are compared side by side on the same noisy machine.

    python benchmarks/trial_cost.py [--tasks example:digits,example:chargpt] [--pairs 5] [--firsts 3]
        [--baseline-src /tmp/before/src] [--write NAME]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import DataLoader

import environment
from redline.hardware.device import probe_device
from redline.plan.layout import has_conv2d, resolve_channels_last
from redline.plan.precision import fast_precisions
from redline.runtime import trial as current
from redline.runtime.contract import split_batch
from redline.runtime.loading import read_batches
from redline.task.spec import load_task


def load_baseline(src: str) -> ModuleType:
    """Another version's runtime/trial.py, importing the rest of redline from this one."""
    path = Path(src) / "redline" / "runtime" / "trial.py"
    spec = importlib.util.spec_from_file_location("baseline_trial", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no trial.py at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def trial_runner(task: Any, module: ModuleType, stop_early: bool) -> Callable[[], tuple[float, list[Any]]]:
    device = torch.device("cpu")
    facts = probe_device(device)
    candidates = fast_precisions(facts)
    model = task.build_model()
    loader = DataLoader(task.train_data, batch_size=task.batch_size, collate_fn=task.collate_fn)
    batch = split_batch(next(read_batches(loader)), "train_data")

    convolutional = has_conv2d(model)

    def layout(precision: str) -> bool:  # as the run lays the model out under each precision
        return resolve_channels_last("auto", facts, has_conv2d=convolutional, precision=precision).value

    def run() -> tuple[float, list[Any]]:
        began = time.perf_counter()
        kwargs = {"layout": layout} if "layout" in inspect.signature(module.run_trial).parameters else {}
        measured = module.run_trial(
            model, task.optimizer, task.loss_fn, batch, device, candidates, stop_early=stop_early, **kwargs
        )
        return time.perf_counter() - began, measured

    return run


def entries_of(task: Any, versions: list[tuple[str, ModuleType]]) -> list[tuple[str, str, Callable[[], Any]]]:
    """Every (version, kind of trial, runner) timed for ``task``: each version with and without early decisions."""
    return [
        (version, "early decisions" if early else "every round", trial_runner(task, module, early))
        for version, module in versions
        for early in (True, False)
    ]


def first_in_fresh_process(spec: str, index: int, baseline_src: str | None) -> float:
    """Entry ``index``'s first trial in a process of its own with empty caches: its wall seconds."""
    command = [sys.executable, __file__, "--tasks", spec, "--first", str(index)]
    command += ["--baseline-src", baseline_src] if baseline_src else []
    with environment.fresh_caches() as env:
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        raise SystemExit(f"the first trial of {spec} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return float(json.loads(found[-1].removeprefix("RESULT "))["wall_s"])


def first_trials(spec: str, count: int, processes: int, baseline_src: str | None) -> list[list[float]]:
    """Each of ``count`` entries' first trial in ``processes`` fresh processes, the entries' order rotated."""
    walls: list[list[float]] = [[] for _ in range(count)]
    for round_ in range(processes):
        for offset in range(count):
            index = (round_ + offset) % count
            walls[index].append(first_in_fresh_process(spec, index, baseline_src))
    return walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="example:digits,example:chargpt")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--firsts", type=int, default=3, help="fresh processes timing each entry's first trial")
    parser.add_argument("--baseline-src", default=None, help="another checkout's src/, timed side by side")
    parser.add_argument("--first", type=int, default=None, help=argparse.SUPPRESS)  # a child: one first trial
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    versions = [("this version", current)]
    if args.baseline_src:
        versions.append((f"baseline ({args.baseline_src})", load_baseline(args.baseline_src)))
    environment.exit_without_cpu_trials()
    if args.first is not None:  # the child of first_in_fresh_process
        wall, _ = entries_of(load_task(args.tasks), versions)[args.first][2]()
        print("RESULT " + json.dumps({"wall_s": wall}), flush=True)
        return
    body = [
        f"`python benchmarks/trial_cost.py --tasks {args.tasks} --pairs {args.pairs} --firsts {args.firsts}"
        + (" --baseline-src DIR" if args.baseline_src else "")
        + "`. Per task, every entry below runs in turn, in rotated order, "
        f'{args.pairs} times after an uncounted trial each; medians. "in fp32 steps" divides the trial\'s '
        "wall time by its own fastest fp32 step: what the trial costs a run that keeps fp32. The counted trials "
        'leave out the first-use costs a real run\'s one trial pays; "first trial" is the median wall time of '
        f"each entry's first trial in {args.firsts} fresh processes (empty TORCHINDUCTOR_CACHE_DIR and "
        "REDLINE_CACHE_DIR), what a run pays.",
        "",
        "| task | version | trial | wall s | first trial, fresh process: wall s | in fp32 steps "
        "| timed steps per candidate | choice |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for spec in args.tasks.split(","):
        task = load_task(spec)
        entries = entries_of(task, versions)
        firsts = first_trials(spec, len(entries), args.firsts, args.baseline_src)
        for _, _, run in entries:
            run()  # uncounted: the first optimizer imports torch._dynamo, the first bf16 step builds its kernels
        walls: list[list[float]] = [[] for _ in entries]
        steps: list[list[float]] = [[] for _ in entries]
        timed: list[list[int]] = [[] for _ in entries]
        choices: list[list[str]] = [[] for _ in entries]
        for round_ in range(args.pairs):
            for offset in range(len(entries)):
                index = (round_ + offset) % len(entries)
                wall, measured = entries[index][2]()
                walls[index].append(wall)
                steps[index].append(wall / measured[0].step_s)
                timed[index].append(len(measured[0].step_times))
                choices[index].append(current.choose(measured, "this CPU").value)
            print(f"{spec}: round {round_ + 1}/{args.pairs} done", flush=True)
        rows = zip(entries, walls, firsts, steps, timed, choices, strict=True)
        for (version, kind, _), wall, first, step, count, chose in rows:
            told = ", ".join(f"{name} x{chose.count(name)}" for name in dict.fromkeys(chose))
            body.append(
                f"| `{spec}` | {version} | {kind} | {environment.median(wall):.3f} | {environment.median(first):.3f} | "
                f"{environment.median(step):.1f} | "
                f"{'/'.join(str(c) for c in sorted(set(count)))} | {told} |"
            )
    environment.publish(args.write, "What auto's precision trial costs", body)


if __name__ == "__main__":
    main()
