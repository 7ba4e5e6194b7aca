"""Trainer vs Runtime loop vs plain loop on the digits task: steady-state step time, side by side.

The Trainer runs its own fit(); at each of its logging points (every ``--steps`` steps) a callback
runs the plain loop and the Runtime loop for as many steps on their own copies of the model, so
the three alternate through one process. The Trainer's window is the time between callbacks less
the time spent inside them: its steps plus its own logging (CSV and JSONL to a temporary folder).
Goal: Trainer within 3% of the plain loop.

    python benchmarks/trainer_overhead.py [--task example:digits] [--rounds 30] [--steps 50] [--write NAME]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import environment
import redline
from overhead import plain_stepper, runtime_stepper
from redline.train.callbacks import Callback
from redline.train.trainer import Trainer


class Interleave(Callback):
    """At each Trainer logging point, time the Trainer's last window, then run the other two loops."""

    def __init__(self, task: redline.Task, steps: int, warmup_rounds: int) -> None:
        self.loops = {
            "plain": plain_stepper(task, torch.device("cpu")),
            "runtime": runtime_stepper(task, torch.device("cpu")),
        }
        self.steps, self.warmup = steps, warmup_rounds
        self.times: dict[str, list[float]] = {"trainer": [], "plain": [], "runtime": []}
        self.round = 0
        self.resumed_at = time.perf_counter()

    def on_step(self, trainer: Trainer, step: int, loss: float) -> None:
        trainer_s = (time.perf_counter() - self.resumed_at) / self.steps
        order = ["plain", "runtime"] if self.round % 2 == 0 else ["runtime", "plain"]
        others = {name: self.loops[name](self.steps) for name in order}
        if self.round >= self.warmup:
            self.times["trainer"].append(trainer_s)
            for name, value in others.items():
                self.times[name].append(value)
        self.round += 1
        self.resumed_at = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="example:digits")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=50, help="steps per loop per round (the Trainer's log_every)")
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()

    task = redline.load_task(args.task)
    warmup = 2
    meter = Interleave(task, args.steps, warmup)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            task,
            runtime=redline.RuntimeOptions(devices="cpu", precision="fp32", compile="off", seed=0),
            max_steps=(args.rounds + warmup) * args.steps,
            max_epochs=10**6,
            log_every=args.steps,
            eval_every=10**9,  # no evaluation inside the timed windows
            out_dir=out,
            progress=False,
            callbacks=[meter],
        )
        trainer.fit()
    med = environment.median
    t = meter.times
    plain = med(t["plain"])
    ratios = {name: [a / b for a, b in zip(t[name], t["plain"], strict=True)] for name in ("trainer", "runtime")}
    body = [
        f"Task `{args.task}`, batch {task.batch_size}, {args.rounds} rounds of {args.steps} steps per loop after "
        f"{warmup} warm-up rounds; fp32, compile off. The Trainer logs CSV and JSONL every {args.steps} steps.",
        "",
        "| loop | median step (ms) | vs plain: ratio of medians | median per-round ratio |",
        "| --- | --- | --- | --- |",
        f"| plain | {plain * 1e3:.3f} | 1 | 1 |",
        *(
            f"| {name} | {med(t[name]) * 1e3:.3f} | **{med(t[name]) / plain:.4f}** | {med(ratios[name]):.4f} |"
            for name in ("runtime", "trainer")
        ),
        "",
        "Goal: Trainer / plain <= 1.03.",
    ]
    environment.publish(args.write, "Trainer overhead vs the plain loop", body)


if __name__ == "__main__":
    main()
