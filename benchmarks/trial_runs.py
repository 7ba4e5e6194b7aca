"""Short runs of one workload add up: chargpt's default run, three times in a row, with auto against fp32.

chargpt's default run (176 steps) is too short to repay a precision trial alone, so before its runs added up every
run kept fp32. Now the first run counts its steps and the second, which brings them to 352, measures. For each
repeat, `redline train --task example:chargpt` runs three times in a row on an empty trial cache with every option
on auto, and three times with `--trial off` (the rule: fp32), the two series in alternating order. The table gives
each run's wall time, the precision and attention kernel it ran, and the trial's seconds; the ratio is fp32's wall
time over auto's for the same run of the series (above 1: auto faster), its median over the repeats, beside the
ratio of the summaries' training samples/s (steps only, the first excluded). Every run has
empty compile caches of its own. "others' CPUs" is how many CPUs other processes kept busy while the run ran (steal
time on a virtual machine included): a run beside other work times that work too.

    python benchmarks/trial_runs.py [--repeats 2] [--write NAME]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import environment
from redline.hardware.contention import Sampler

SPEC, RUNS = "example:chargpt", 3


def train(cache: str, *flags: str) -> tuple[dict, float, float | None]:
    """Run `redline train` once on the trial cache ``cache``; return its summary, the process's wall seconds, and how
    many CPUs other processes kept busy meanwhile (hardware/contention.py; None where it cannot be read)."""
    command = [sys.executable, "-m", "redline", "train", "--task", SPEC, "--json", "--no-progress", *flags]
    with environment.fresh_caches() as env:
        sampler = Sampler().start()
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env={**env, "REDLINE_CACHE_DIR": cache})
        wall = time.perf_counter() - start
        load = sampler.stop(threads=1)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout), wall, load.others if load is not None else None


def series(*flags: str) -> list[tuple[dict, float, float | None]]:
    """Three runs in a row on one empty trial cache."""
    with tempfile.TemporaryDirectory() as cache:
        return [train(cache, *flags) for _ in range(RUNS)]


def load(others: float | None) -> str:
    return "?" if others is None else f"{others:.2f}"


def ran(summary: dict) -> str:
    plan = summary["plan"]
    return f"{plan['precision']['value']}, {plan['attention']['value']} attention"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    ratios: list[list[float]] = [[] for _ in range(RUNS)]
    steps: list[list[float]] = [[] for _ in range(RUNS)]
    rows = []
    for repeat in range(args.repeats):
        order = [("auto", ()), ("fp32", ("--trial", "off"))]
        done = {name: series(*flags) for name, flags in (order if repeat % 2 == 0 else order[::-1])}
        for i, ((auto, auto_s, auto_load), (fp32, fp32_s, fp32_load)) in enumerate(
            zip(done["auto"], done["fp32"], strict=True)
        ):
            ratios[i].append(fp32_s / auto_s)
            steps[i].append(auto["samples_per_s"] / fp32["samples_per_s"])
            trial = auto.get("trial_seconds")
            rows.append(
                f"| {repeat + 1} | {i + 1} | {ran(auto)} | {'' if trial is None else f'{trial:.1f}'} | {auto_s:.1f} "
                f"| {load(auto_load)} | {ran(fp32)} | {fp32_s:.1f} | {load(fp32_load)} | {steps[i][-1]:.3f}x "
                f"| {fp32_s / auto_s:.3f}x |"
            )
            print(rows[-1], flush=True)
            if repeat == 0:
                print("   auto's precision reason:", auto["plan"]["precision"]["reason"], flush=True)
    body = [
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        "| repeat | run | auto ran | trial s | auto wall s | others' CPUs | `--trial off` ran | wall s | others' CPUs "
        "| steps: auto/fp32 samples/s | fp32/auto wall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "Median fp32/auto wall time by run: "
        + ", ".join(f"run {i + 1} **{environment.median(r):.3f}x**" for i, r in enumerate(ratios))
        + "; median auto/fp32 training samples/s (the summary's, steps only): "
        + ", ".join(f"run {i + 1} **{environment.median(r):.3f}x**" for i, r in enumerate(steps))
        + ".",
    ]
    environment.publish(args.write, "Short runs of one workload add up to a trial", body)


if __name__ == "__main__":
    main()
