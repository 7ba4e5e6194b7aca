"""Measured auto vs fp32 through `redline train`: does the trial's pick make the run faster, and what does it cost?

For each task, `redline train` runs with every option on auto (its precision measured by a trial
on this machine, the trial cached by an uncounted first run) and with `--precision fp32`, in
alternating order. The figures are medians of the per-pair ratios fp32/auto (above 1: auto
faster): training throughput from the summary (steps only) and the whole process's wall time.
One more auto run with an empty cache gives the trial's own cost.

    python benchmarks/auto_trial.py [--pairs 5] [--write NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import environment

RUNS = {"example:digits": ["--epochs", "30"], "example:chargpt": ["--max-steps", "600"]}  # long enough to trial


def train(spec: str, extra: list[str], cache: str, *flags: str) -> tuple[dict, float]:
    """Run `redline train` once; return its summary and the process's wall seconds."""
    command = [sys.executable, "-m", "redline", "train", "--task", spec, *extra, "--json", "--no-progress", *flags]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "REDLINE_CACHE_DIR": cache})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    med = environment.median
    body = [
        f"{args.pairs} pairs per task in alternating order, after one uncounted auto run that measured and cached "
        "the trial. Ratios are fp32/auto per pair, then the median (above 1: auto faster).",
        "",
        "| task | auto chose | trial said | fp32 samples/s | auto samples/s | steps: fp32/auto time "
        "| whole process: fp32/auto wall | trial cost (s, cold cache) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for spec, extra in RUNS.items():
        with tempfile.TemporaryDirectory() as cold, tempfile.TemporaryDirectory() as warm:
            first, _ = train(spec, extra, warm)  # measures, and caches for the pairs
            rates: dict[str, list[float]] = {"auto": [], "fp32": []}
            walls: dict[str, list[float]] = {"auto": [], "fp32": []}
            for i in range(args.pairs):
                order = [("auto", ()), ("fp32", ("--precision", "fp32"))]
                for name, flags in order if i % 2 == 0 else order[::-1]:
                    summary, wall = train(spec, extra, warm, *flags)
                    rates[name].append(summary["samples_per_s"])
                    walls[name].append(wall)
            _, cold_wall = train(spec, extra, cold)
            _, warm_wall = train(spec, extra, warm)
        chosen = first["plan"]["precision"]
        steps = med([a / f for a, f in zip(rates["auto"], rates["fp32"], strict=True)])
        whole = med([f / a for a, f in zip(walls["auto"], walls["fp32"], strict=True)])
        said = chosen["reason"].split(" (")[0].removeprefix("measured: ")
        body.append(
            f"| {spec} {' '.join(extra)} | {chosen['value']} | {said} | {med(rates['fp32']):,.0f} "
            f"| {med(rates['auto']):,.0f} | **{steps:.3f}x** | {whole:.3f}x | {cold_wall - warm_wall:.1f} |"
        )
        print(body[-1], flush=True)
    body += [
        "",
        "The trial cost is one cold-cache run's wall time less one warm-cache run's: noisy on a shared machine,",
        "and paid once per model and machine.",
    ]
    environment.publish(args.write, "Measured auto precision vs fp32 through redline train", body)


if __name__ == "__main__":
    main()
