"""The naive loop vs redline's auto Plan on the built-in examples, side by side in one run.

The naive loop is the way a tutorial writes it: eager fp32, ``.to(device)`` per batch, a default
DataLoader. The auto run is ``redline.Runtime()`` with every option on "auto" and the run's length
given as ``planned_steps``. Each pair runs in alternating order; the figures are the medians of the
ratios naive/auto (above 1 means redline is faster): end to end (model set-up, compile and all
steps) and at steady state (samples/s after the first tenth of the steps, and never before step
STEADY_FROM: the Runtime's own check of its precision runs the first 35 steps).

Every run, naive and auto alike, is a process of its own with empty compile and trial caches
(environment.fresh_caches): each pays its own cold compile, as a user's first run does, and no run
reads what an earlier one cached (torch's FX graphs, a tuned Plan) or inherits its process-wide
settings (TF32, deterministic algorithms, the attention kernel).

    python benchmarks/speedup.py [--device cpu|cuda] [--steps 300] [--repeats 5] [--write NAME]
        [--options precision=bf16-mixed] [--against precision=bf16-mixed,attention=flash]

``--options`` gives the Runtime run options of its own (the rest stay auto); ``--against`` sets a Runtime run with
those options in the naive loop's place, to time one choice of redline's against another side by side.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

import environment
import redline
from redline.runtime.compile_check import STEPS as CHECK_STEPS

# The steady window starts after the Runtime's check of its precision (18 steps in the rule's precision, 17 in the
# other: runtime/compile_check.py), so no step of the slower precision is counted; a check of compile or CUDA
# graphs too (on a GPU) runs 17 steps more for each.
STEADY_FROM = CHECK_STEPS + 1


@dataclass
class Timing:
    total_s: float
    steady_samples_per_s: float
    plan: str = ""


def _timed_steps(steps: int, batches: Iterable[Any], step_fn: Any, device: torch.device, start: float) -> Timing:
    warm = max(steps // 10, STEADY_FROM)
    samples = 0
    mark = start
    for i, (inputs, targets) in enumerate(itertools.islice(batches, steps)):
        step_fn(inputs, targets)
        if i + 1 == warm:
            _sync(device)
            mark = time.perf_counter()
        elif i + 1 > warm:
            samples += len(targets)
    _sync(device)
    end = time.perf_counter()
    return Timing(total_s=end - start, steady_samples_per_s=samples / (end - mark))


def naive(task: redline.Task, device: torch.device, steps: int) -> Timing:
    start = time.perf_counter()
    torch.manual_seed(0)
    model = task.build_model().to(device)
    optimizer = task.optimizer(model.parameters())
    loader = DataLoader(task.train_data, batch_size=task.batch_size, shuffle=True, drop_last=True)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        inputs, targets = inputs.to(device), targets.to(device)
        loss = task.loss_fn(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return _timed_steps(steps, _forever(loader), step, device, start)


def auto(task: redline.Task, device: torch.device, steps: int, options: dict[str, Any] | None = None) -> Timing:
    start = time.perf_counter()
    torch.manual_seed(0)
    # `with`: closing puts the process-wide settings back (TF32, deterministic, the attention kernel)
    with redline.Runtime(**{"devices": str(device), "planned_steps": steps, **(options or {})}) as rt:
        model, optimizer = rt.setup(task.build_model(), task.optimizer)
        batches = DataLoader(task.train_data, batch_size=task.batch_size, shuffle=True, drop_last=True)
        loader = rt.setup_loader(batches)

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
            with rt.autocast():
                loss = task.loss_fn(model(inputs), targets)
            rt.backward(loss)
            rt.step(optimizer)

        timing = _timed_steps(steps, _forever(loader), step, device, start)
        timing.plan = "; ".join(f"{axis}={value}" for axis, value, _ in rt.explain().rows())
    return timing


def run_alone(kind: str, spec: str, device: str, steps: int, options: str) -> Timing:
    """Run one timed run (``kind``: naive or auto) in a process of its own with fresh caches; return its Timing."""
    command = [sys.executable, __file__, "--alone", kind, "--tasks", spec, "--device", device, "--steps", str(steps)]
    with environment.fresh_caches() as env:
        done = subprocess.run([*command, "--options", options], capture_output=True, text=True, env=env, check=False)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not found:
        raise SystemExit(f"the {kind} run of {spec} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return Timing(**json.loads(found[-1].removeprefix("RESULT ")))


def alone(args: argparse.Namespace) -> None:
    """The child's side of run_alone: one run, its Timing printed as a RESULT line."""
    task, device = redline.load_task(args.tasks), torch.device(args.device)
    timing = (
        naive(task, device, args.steps)
        if args.alone == "naive"
        else auto(task, device, args.steps, _options(args.options))
    )
    print("RESULT " + json.dumps(asdict(timing)), flush=True)


def _options(text: str) -> dict[str, Any]:
    """``K=V,K=V`` as Runtime options: integers, true/false and none read as such, the rest as given."""
    words = {"true": True, "false": False, "none": None}
    options: dict[str, Any] = {}
    for pair in filter(None, text.split(",")):
        key, _, value = pair.partition("=")
        options[key] = words.get(value.lower(), int(value) if value.isdigit() else value)
    return options


def _said(options: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items())


def _forever(loader: Iterable[Any]) -> Any:
    return itertools.chain.from_iterable(itertools.repeat(loader))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tasks", default="example:digits,example:chargpt")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    parser.add_argument("--options", default="", help="the Runtime run's options: K=V,K=V")
    parser.add_argument("--against", default=None, help="a Runtime run in the naive loop's place")
    parser.add_argument("--alone", choices=["naive", "auto"], help=argparse.SUPPRESS)  # one run, in a child
    args = parser.parse_args()
    if args.steps <= STEADY_FROM:
        parser.error(
            f"--steps={args.steps} leaves no steady steps; expected more than {STEADY_FROM} (the first "
            f"{STEADY_FROM - 1} are the Runtime's precision check). hint: --steps 300"
        )
    if args.alone:
        return alone(args)
    options, against = _options(args.options), args.against is not None
    base_name = "naive" if args.against is None else f"Runtime({_said(_options(args.against))})"

    def ours(spec: str, steps: int) -> Timing:
        return run_alone("auto", spec, args.device, steps, args.options)

    def baseline(spec: str, steps: int) -> Timing:
        if args.against is None:
            return run_alone("naive", spec, args.device, steps, "")
        return run_alone("auto", spec, args.device, steps, args.against)

    body = [
        f"{args.steps} steps per run, {args.repeats} pairs per task in alternating order after one uncounted "
        "warm-up pair. Speed-ups are naive/auto time (above 1: redline faster): the ratio of the medians, "
        "and in brackets the median of the per-pair ratios. Every run is a process of its own with empty "
        "TORCHINDUCTOR_CACHE_DIR and REDLINE_CACHE_DIR: each pays its own cold compile, and none reads a tuned "
        "Plan or measured choice an earlier run cached. Totals run from the model's set-up to the last step "
        f"(process start-up and imports left out); steady samples/s counts the steps after step "
        f"{max(args.steps // 10, STEADY_FROM)} (the first tenth, and never the Runtime's {STEADY_FROM - 1}-step "
        "precision check).",
        *([f"auto is Runtime({_said(options)}); the naive loop's place is taken by {base_name}."] if against else []),
        *([f"auto is Runtime({_said(options)})."] if options and not against else []),
        "",
        "| task | naive total (s) | auto total (s) | end-to-end speed-up | naive samples/s | auto samples/s "
        "| steady-state speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    plans = []
    for spec in args.tasks.split(","):
        runs: dict[str, list[Timing]] = {"naive": [], "auto": []}
        warm_up = max(STEADY_FROM + 1, args.steps // 10)
        baseline(spec, warm_up)  # not counted: the disk's first reads of torch and the data
        ours(spec, warm_up)
        for i in range(args.repeats):
            order = [("naive", baseline), ("auto", ours)]
            for name, fn in order if i % 2 == 0 else order[::-1]:
                runs[name].append(fn(spec, args.steps))
        end_to_end = [n.total_s / a.total_s for n, a in zip(runs["naive"], runs["auto"], strict=True)]
        steady = [
            a.steady_samples_per_s / n.steady_samples_per_s for n, a in zip(runs["naive"], runs["auto"], strict=True)
        ]
        med = environment.median
        naive_total, auto_total = med([r.total_s for r in runs["naive"]]), med([r.total_s for r in runs["auto"]])
        naive_rate = med([r.steady_samples_per_s for r in runs["naive"]])
        auto_rate = med([r.steady_samples_per_s for r in runs["auto"]])
        body.append(
            f"| {spec} | {naive_total:.2f} | {auto_total:.2f} | **{naive_total / auto_total:.3f}x** "
            f"({med(end_to_end):.3f}x) | {naive_rate:,.0f} | {auto_rate:,.0f} | **{auto_rate / naive_rate:.3f}x** "
            f"({med(steady):.3f}x) |"
        )
        plans.append(f"- {spec}: {runs['auto'][0].plan}")
        if args.against is not None:
            plans.append(f"- {spec}, {base_name}: {runs['naive'][0].plan}")
        print(body[-1], flush=True)
    body += ["", "The auto Plan chose:", *plans]
    title = "Speed-up of the auto Plan over the naive loop"
    if options:
        title = f"Speed-up of Runtime({_said(options)}) over the naive loop"
    if against:
        title = f"Runtime({_said(options)}) against {base_name}, in a user's own loop"
    environment.publish(args.write, title, body, args.device)


if __name__ == "__main__":
    main()
