"""A training graph's backward compiled with its forward, against torch's default (at the first backward).

redline has torch compile the first training graph's backward in the forward's call (runtime/compile.py), so that
a backward the compiler fails on falls back to eager like a forward does. The compiled graphs are the same, so the
compile's time and the steps' speed should be too: this checks it. Each run is a process of its own with empty
compile caches (a cold compile, as a user's first run pays): a Runtime with compile on trains the example for
``--steps`` steps at fp32, its backward lowered with the forward (as redline does) or at the first backward (the
setting left to torch). The two take turns, ``--rounds`` times each; the table gives each one's compile seconds (the
Plan's, backward included) and steady step time (the median of the steps after the first two), and the
round-by-round ratios, lowered over lazy. Each run's first loss and last loss show the two train alike.

    python benchmarks/compile_backward.py [--rounds 3] [--steps 60] [--task example:chargpt] [--write NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import environment

EXAMPLES = (("example:digits", 64), ("example:chargpt", 32))
FORMS = ("lowered", "lazy")


def one_run(spec: str, batch_size: int, steps: int, form: str) -> dict[str, float]:
    """In this process: train ``spec`` compiled for ``steps`` steps; its compile seconds, step time and losses."""
    import torch

    import redline.runtime.compile as compiling
    from redline import Runtime, RuntimeOptions
    from redline.task.spec import load_task

    if form == "lazy":  # torch's default: each backward compiles at its first backward
        compiling.backward_with_forward = contextlib.nullcontext  # type: ignore[assignment]
    torch.manual_seed(0)
    task = load_task(spec)
    loader = torch.utils.data.DataLoader(task.train_data, batch_size=batch_size, shuffle=True, drop_last=True)
    options = RuntimeOptions(devices="cpu", precision="fp32", compile="on")
    times, losses = [], []
    with Runtime(options) as rt:
        model, optimizer = rt.setup(task.build_model(), task.optimizer)
        batches = iter(rt.setup_loader(loader))
        for _ in range(steps):
            try:
                inputs, targets = next(batches)
            except StopIteration:
                batches = iter(rt.setup_loader(loader))
                inputs, targets = next(batches)
            started = time.perf_counter()
            loss = task.loss_fn(model(inputs), targets)
            rt.backward(loss)
            rt.step(optimizer)
            times.append(time.perf_counter() - started)
            losses.append(float(loss.detach()))
        seconds = rt.compile_seconds or 0.0
    return {"compile_s": seconds, "step_s": statistics.median(times[2:]), "first": losses[0], "last": losses[-1]}


def run_in_process(spec: str, batch_size: int, steps: int, form: str) -> dict[str, float]:
    with environment.fresh_caches() as env:
        words = [sys.executable, str(Path(__file__)), "--one", spec, str(batch_size), str(steps), form]
        done = subprocess.run(words, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{spec} {form} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--task", action="append", default=None, help="only this example (repeatable)")
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    parser.add_argument("--one", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        spec, batch_size, steps, form = args.one
        print(json.dumps(one_run(spec, int(batch_size), int(steps), form)))
        return
    rows = []
    for spec, batch_size in [(spec, size) for spec, size in EXAMPLES if spec in (args.task or [spec])]:
        runs: dict[str, list[dict[str, float]]] = {form: [] for form in FORMS}
        for round_ in range(args.rounds):
            for form in FORMS if round_ % 2 == 0 else FORMS[::-1]:
                runs[form].append(run_in_process(spec, batch_size, args.steps, form))
                print(spec, form, runs[form][-1], flush=True)
        cells = []
        for key in ("compile_s", "step_s"):
            ratios = [a[key] / b[key] for a, b in zip(runs["lowered"], runs["lazy"], strict=True)]
            scale, unit = (1.0, "s") if key == "compile_s" else (1e3, "ms")
            medians = [statistics.median(r[key] for r in runs[form]) * scale for form in FORMS]
            cells.append(
                f"{medians[0]:.2f} / {medians[1]:.2f} {unit} | **{statistics.median(ratios):.3f}x** "
                f"({min(ratios):.3f}-{max(ratios):.3f})"
            )
        losses = {form: f"{runs[form][0]['first']:.4f} -> {runs[form][0]['last']:.4f}" for form in FORMS}
        rows.append(f"| {spec} | {batch_size} | {' | '.join(cells)} | {losses['lowered']} | {losses['lazy']} |")
    body = environment.table_page(
        __doc__,
        f"rounds: {args.rounds}; steps a run: {args.steps}; precision fp32; each run in its own process.",
        ["task", "batch", "compile s, lowered / lazy", "compile ratio (range)", "step, lowered / lazy",
         "step ratio (range)", "loss, lowered (round 1)", "loss, lazy (round 1)"],
        rows,
    )  # fmt: skip
    environment.publish(args.write, "Backward compiled with the forward", body)


if __name__ == "__main__":
    main()
