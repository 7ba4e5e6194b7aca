"""Measured auto vs fp32 through `redline train`: does the trial's pick make the run faster, and what does it cost?

For each task, `redline train` runs with every option on auto (its precision measured by a trial
on this machine, the trial cached by an uncounted first run) and with `--precision fp32`, in
alternating order. The figures are medians of the per-pair ratios fp32/auto (above 1: auto
faster): training throughput from the summary (steps only) and the whole process's wall time.
Each round also runs auto with an empty cache (it measures its trial again), at the round's end
or its start in turn; the trial's cost is the median of the rounds' cold auto less warm auto wall
times. Every run has empty compile caches of its own (TORCHINDUCTOR_CACHE_DIR), so the cold and
warm runs differ only in the trial.

    python benchmarks/auto_trial.py [--pairs 5] [--write NAME]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import environment

RUNS = {"example:digits": ["--epochs", "30"], "example:chargpt": ["--max-steps", "600"]}  # long enough to trial


def train(spec: str, extra: list[str], cache: str | None, *flags: str) -> tuple[dict, float]:
    """Run `redline train` once with empty compile caches and the trial cache ``cache`` (None: an empty one too);
    return its summary and the process's wall seconds."""
    command = [sys.executable, "-m", "redline", "train", "--task", spec, *extra, "--json", "--no-progress", *flags]
    with environment.fresh_caches() as env:
        start = time.perf_counter()
        done = subprocess.run(
            command, capture_output=True, text=True, env={**env, "REDLINE_CACHE_DIR": cache or env["REDLINE_CACHE_DIR"]}
        )
        wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout), wall


def trial_cost(cold_s: list[float], warm_s: list[float]) -> str:
    """The trial's cost in seconds: the median over rounds of cold less warm auto wall time, with the range."""
    each = [cold - warm for cold, warm in zip(cold_s, warm_s, strict=True)]
    return f"{environment.median(each):.1f} ({min(each):.1f} to {max(each):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    med = environment.median
    body = [
        f"{args.pairs} pairs per task in alternating order, after one uncounted auto run that measured and cached "
        "the trial. Ratios are fp32/auto per pair, then the median (above 1: auto faster). Each round also ran "
        "auto with an empty trial cache (after the pair, then before it in turn); the trial's cost is the median "
        "over rounds of that run's wall time less the warm auto run's, with the range over rounds. Every run had "
        "empty compile caches (TORCHINDUCTOR_CACHE_DIR) of its own.",
        "",
        "| task | auto chose | trial said | fp32 samples/s | auto samples/s | steps: fp32/auto time "
        "| whole process: fp32/auto wall | trial cost (s): median (range) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for spec, extra in RUNS.items():
        with tempfile.TemporaryDirectory() as warm:
            first, _ = train(spec, extra, warm)  # measures, and caches for the pairs
            rates: dict[str, list[float]] = {"auto": [], "fp32": []}
            walls: dict[str, list[float]] = {"auto": [], "fp32": [], "cold": []}
            for i in range(args.pairs):
                order = [("auto", warm, ()), ("fp32", warm, ("--precision", "fp32")), ("cold", None, ())]
                for name, cache, flags in order if i % 2 == 0 else order[::-1]:
                    summary, wall = train(spec, extra, cache, *flags)
                    rates.setdefault(name, []).append(summary["samples_per_s"])
                    walls[name].append(wall)
        trial_s = trial_cost(walls["cold"], walls["auto"])
        chosen = first["plan"]["precision"]
        steps = med([a / f for a, f in zip(rates["auto"], rates["fp32"], strict=True)])
        whole = med([f / a for a, f in zip(walls["auto"], walls["fp32"], strict=True)])
        said = chosen["reason"].split(" (")[0].removeprefix("measured: ")
        body.append(
            f"| {spec} {' '.join(extra)} | {chosen['value']} | {said} | {med(rates['fp32']):,.0f} "
            f"| {med(rates['auto']):,.0f} | **{steps:.3f}x** | {whole:.3f}x | {trial_s} |"
        )
        print(body[-1], flush=True)
    body += [
        "",
        "The trial is paid once per model and machine: later runs read it from the cache.",
    ]
    environment.publish(args.write, "Measured auto precision vs fp32 through redline train", body)


if __name__ == "__main__":
    main()
