"""The naive loop vs redline's auto Plan on the built-in examples, side by side in one run.

The naive loop is the way a tutorial writes it: eager fp32, ``.to(device)`` per batch, a default
DataLoader. The auto run is ``redline.Runtime()`` with every option on "auto" and the run's length
given as ``planned_steps``. Each pair runs in alternating order; the figures are the medians of the
ratios naive/auto (above 1 means redline is faster): end to end (model set-up, compile and all
steps) and at steady state (samples/s after the first tenth of the steps).

    python benchmarks/speedup.py [--device cpu|cuda] [--steps 300] [--repeats 5] [--write NAME]
        [--options precision=bf16-mixed] [--against precision=bf16-mixed,attention=flash]

``--options`` gives the Runtime run options of its own (the rest stay auto); ``--against`` sets a Runtime run with
those options in the naive loop's place, to time one choice of redline's against another side by side.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

import environment
import redline


@dataclass
class Timing:
    total_s: float
    steady_samples_per_s: float
    plan: str = ""


def _timed_steps(steps: int, batches: Iterable[Any], step_fn: Any, device: torch.device, start: float) -> Timing:
    warm = max(1, steps // 10)
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
    rt = redline.Runtime(**{"devices": str(device), "planned_steps": steps, **(options or {})})
    model, optimizer = rt.setup(task.build_model(), task.optimizer)
    loader = rt.setup_loader(DataLoader(task.train_data, batch_size=task.batch_size, shuffle=True, drop_last=True))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        with rt.autocast():
            loss = task.loss_fn(model(inputs), targets)
        rt.backward(loss)
        rt.step(optimizer)

    timing = _timed_steps(steps, _forever(loader), step, device, start)
    timing.plan = "; ".join(f"{axis}={value}" for axis, value, _ in rt.explain().rows())
    return timing


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
    parser.add_argument("--options", type=_options, default={}, help="the Runtime run's options: K=V,K=V")
    parser.add_argument("--against", type=_options, default=None, help="a Runtime run in the naive loop's place")
    args = parser.parse_args()
    device = torch.device(args.device)
    ours = functools.partial(auto, options=args.options)
    baseline = naive if args.against is None else functools.partial(auto, options=args.against)
    against = args.against is not None
    base_name = "naive" if args.against is None else f"Runtime({_said(args.against)})"

    body = [
        f"{args.steps} steps per run, {args.repeats} pairs per task in alternating order after one uncounted "
        "warm-up pair. Speed-ups are naive/auto time (above 1: redline faster): the ratio of the medians, "
        "and in brackets the median of the per-pair ratios.",
        *(
            [f"auto is Runtime({_said(args.options)}); the naive loop's place is taken by {base_name}."]
            if against
            else []
        ),
        *([f"auto is Runtime({_said(args.options)})."] if args.options and not against else []),
        "",
        "| task | naive total (s) | auto total (s) | end-to-end speed-up | naive samples/s | auto samples/s "
        "| steady-state speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    plans = []
    for spec in args.tasks.split(","):
        task = redline.load_task(spec)
        runs: dict[str, list[Timing]] = {"naive": [], "auto": []}
        baseline(task, device, max(10, args.steps // 10))  # warm-up, not counted: first-touch costs
        ours(task, device, max(10, args.steps // 10))
        for i in range(args.repeats):
            order = [("naive", baseline), ("auto", ours)]
            for name, fn in order if i % 2 == 0 else order[::-1]:
                runs[name].append(fn(task, device, args.steps))
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
    if args.options:
        title = f"Speed-up of Runtime({_said(args.options)}) over the naive loop"
    if args.against is not None:
        title = f"Runtime({_said(args.options)}) against {base_name}, in a user's own loop"
    environment.publish(args.write, title, body, args.device)


if __name__ == "__main__":
    main()
