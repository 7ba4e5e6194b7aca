"""A CPU's fused optimizer kernel against the default implementation: the Runtime's setup timing, and whole steps.

For each example, the optimizer its Task builds is first timed as the Runtime times it at setup
(runtime/fused.py: a copy of its parameters stepped as given and fused, alternating), then the naive loop trains
the example's model twice side by side, once with that optimizer as given and once rebuilt fused, in rounds of
``--window`` steps whose order alternates, after a warm-up; the ratio is the median window of the loop as given
over the fused one's (above 1: fused faster), with the spread of the round-by-round ratios. The Runtime's own
choice, with its reason, is the Plan's `optimizer` row of a Runtime set up on the same model. Timings on a shared
machine are noisy: the rounds alternate so that both loops see the same noise.

    python benchmarks/fused_optimizer.py [--rounds 30] [--write NAME]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import environment
from redline import Runtime, RuntimeOptions
from redline.bench import loops
from redline.bench.matrix import Setting
from redline.runtime.fused import time_fused
from redline.runtime.optimizer import rebuild_optimizer
from redline.task import Task
from redline.task.spec import load_task

EXAMPLES = (("example:chargpt", 32, 10), ("example:digits", 64, 50))  # task, batch size, steps a window


def loops_side_by_side(task: Task, batch_size: int, window: int, rounds: int) -> tuple[float, float, float, float]:
    """The naive loop's median seconds a step as given and fused, and the round-by-round ratio's quartiles."""
    runners = []
    for fused in (False, True):
        runner = loops.naive_runner(task, Setting("naive", "cpu", "fp32", False, batch_size), seed=0)
        optimizer = task.optimizer(runner.model.parameters())
        optimizer = rebuild_optimizer(optimizer, fused=True) if fused else optimizer

        def step(inputs, targets, model=runner.model, optimizer=optimizer, loss_fn=task.loss_fn):
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            return loss

        runner.step_fn = step
        runner.run(3)
        runners.append(runner)
    times: list[list[float]] = [[], []]
    for round_ in range(rounds):
        for i in (0, 1) if round_ % 2 == 0 else (1, 0):
            started = time.perf_counter()
            runners[i].run(window)
            times[i].append((time.perf_counter() - started) / window)
    ratios = sorted(a / b for a, b in zip(*times, strict=True))
    return statistics.median(times[0]), statistics.median(times[1]), ratios[len(ratios) // 4], ratios[-len(ratios) // 4]


def plan_row(task: Task) -> str:
    with Runtime(RuntimeOptions(devices="cpu", precision="fp32", compile="off")) as rt:
        rt.setup(task.build_model(), task.optimizer)
        row = rt.explain().optimizer
    return f"{row.value}: {row.reason}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    rows, plans = [], []
    for spec, batch_size, window in EXAMPLES:
        task = load_task(spec)
        optimizer = task.optimizer(task.build_model().parameters())
        timed = time_fused(optimizer)
        setup = "failed" if isinstance(timed, str) else f"{timed.given_s / timed.fused_s:.2f}x ({timed.told()})"
        given, fused, low, high = loops_side_by_side(task, batch_size, window, args.rounds)
        rows.append(
            f"| {spec} | {type(optimizer).__name__} | {batch_size} | {setup} | {given * 1e3:.2f} | {fused * 1e3:.2f} "
            f"| **{given / fused:.3f}x** | {low:.3f}-{high:.3f} |"
        )
        plans.append(f"- {spec}: {plan_row(task)}")
        print(rows[-1], plans[-1], sep="\n", flush=True)
    header = [
        "task", "optimizer", "batch", "setup timing: fused's step, as fast", "naive step as given (ms)", "fused (ms)",
        "whole step: given/fused", "rounds' quartiles",
    ]  # fmt: skip
    settings = f"torch threads: {torch.get_num_threads()}; rounds: {args.rounds}."
    body = [
        *environment.table_page(__doc__, settings, header, rows),
        "",
        "The Runtime's Plan, set up on each model (fp32, eager):",
        "",
        *plans,
    ]
    environment.publish(args.write, "Fused optimizer on a CPU", body)


if __name__ == "__main__":
    main()
