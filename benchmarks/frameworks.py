"""The same Task for the same steps under plain PyTorch, Accelerate, Lightning (Fabric, Trainer) and redline.

Each entry trains in its own process (benchmarks/framework_runners.py), so imports and compile
caches do not leak between entries, and the entries take turns in interleaved rounds (round 1:
A B C ..., round 2 in rotated order, ...), so a noisy machine's slow spells fall on all of them.
Per process: the whole process's wall time (launch to exit, timed here), the training loop's
time (first forward to last optimizer step, timed in the child with a device sync) and the
steady-state samples/s (the steps after the first 10%). The tables give medians over rounds, their
ratios to the plain loop (above 1: faster than plain), and the same for each entry's fastest run.

The peers live in their own environment, not in redline's dependencies:

    python3 -m venv .venv-peers
    .venv-peers/bin/pip install -c constraints.txt torch==2.13.0
    .venv-peers/bin/pip install -c constraints.txt -r benchmarks/peers-requirements.txt
    .venv-peers/bin/pip install -c constraints.txt -e '.[serve]'   # serve.py starts redline's server with it too
    .venv-peers/bin/python benchmarks/frameworks.py [--tasks example:digits,example:chargpt] [--steps N]
        [--rounds 3] [--frameworks plain,accelerate,...] [--device cpu] [--python PY] [--write NAME]

Children run with ``--python`` (default: .venv-peers/bin/python when it exists, else this Python)
and import redline from this checkout's src/. An entry whose framework is not installed there
is reported as such; the rest still run (a GPU machine with no peers installed: ``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import environment

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "framework_runners.py"
DEFAULT_STEPS = {"example:digits": 600, "example:chargpt": 300}  # about 15 minutes for 3 rounds on 2 CPU cores


@dataclass(frozen=True)
class Entry:
    name: str  # framework_runners.RUNNERS key
    label: str
    ran: str  # what it runs, in plain words


ENTRIES = [
    Entry("plain", "plain PyTorch", "the tutorial loop: eager fp32, `.to(device)`, zero_grad/backward/step"),
    Entry("accelerate", "Accelerate", "`Accelerator()` defaults: mixed_precision='no' (fp32), no compile"),
    Entry(
        "accelerate-bf16", "Accelerate bf16", "`Accelerator(mixed_precision='bf16')`, as its docs advise; no compile"
    ),
    Entry("fabric", "Fabric", "`Fabric()` defaults: precision '32-true', no compile"),
    Entry("fabric-bf16", "Fabric bf16", "`Fabric(precision='bf16-mixed')`, no compile"),
    Entry("lightning", "Lightning Trainer", "`Trainer(max_steps=N)`, logger, checkpoints, progress bar, summary off"),
    Entry("lightning-bf16", "Lightning Trainer bf16", "the same Trainer with `precision='bf16-mixed'`"),
    Entry(
        "redline-trainer",
        "redline Trainer (auto)",
        "`redline.Trainer` defaults (seed 0), no validation, no out_dir: precision measured by a trial when the run "
        "repays one; its own seeded sampler, so its batches differ from the others'",
    ),
    Entry("redline-runtime", "redline Runtime (auto)", "the README's Runtime loop, every option on auto"),
    Entry(
        "redline-tuned",
        "redline tuned",
        "`redline tune --planned-steps N` once per task before the rounds (its time is not in the rows), then "
        "the Runtime loop with `Runtime(plan='tuned')`, which runs that tune's settings",
    ),
]


def child_env(cache: str) -> dict[str, str]:
    """A child's environment: this checkout's src/, and redline's trial cache and torch's compile caches in
    ``cache``, so a run pays its own cold compile as it pays its own trial."""
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    inductor = str(Path(cache) / "inductor")
    return {**os.environ, "PYTHONPATH": path, "REDLINE_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": inductor}


def tune_once(python: str, task: str, steps: int, device: str, into: Path, budget: float) -> str:
    """Run `redline tune` for ``task`` into the cache folder ``into`` within ``budget`` seconds; return what it chose
    and how long it took."""
    command = [python, "-m", "redline", "tune", "--task", task, "--devices", device, "--planned-steps", str(steps),
               "--budget", f"{budget:g}"]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run([*command, "--json"], capture_output=True, text=True, env=child_env(str(into)), check=False)
    if done.returncode != 0:  # its error line, not the hint under it (a spent budget names the axes left)
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        return f"redline tune failed: {next((line for line in lines if line.startswith('error:')), lines[-1])}"
    best = json.loads(done.stdout)["best"]
    return f"redline tune took {time.perf_counter() - start:.0f} s and chose {best}"


def run_entry(
    python: str, name: str, task: str, steps: int, device: str, timeout_s: float, tuned: Path | None = None
) -> dict[str, Any]:
    """Run one entry in a fresh process; return its RESULT with the process's wall seconds added.

    Each run starts with empty redline and compile caches (it pays its trial and compile); ``tuned``, a cache
    holding a tune, is copied in first for the tuned entry.
    """
    command = [python, str(RUNNER), "--framework", name, "--task", task, "--steps", str(steps), "--device", device]
    with tempfile.TemporaryDirectory() as cache:
        if tuned is not None:
            shutil.copytree(tuned / "tuned", Path(cache) / "tuned")
        env = child_env(cache)
        waited, start = cpu_waited_s(), time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"status": f"failed: no result within {timeout_s:g} s"}
        wall = time.perf_counter() - start
        busy = None if waited is None else (cpu_waited_s() - waited) / wall  # type: ignore[operator]
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"status": f"failed (exit {done.returncode}): {last}"}
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "process_s": wall, "cpu_wait": busy}


TUNES: dict[str, str] = {}  # task -> what its one `redline tune` chose, for the notes

# A run is redone (twice at most) when some task waited for a CPU more than this share of its time:
# alone, a child makes about 1% here; the slow spells of this shared 2-core machine (runs 10-20x slower)
# showed 45-85%. Before each run the parent waits (a minute at most) for the 10 s average to fall under CALM.
BUSY, CALM, REDO = 0.25, 0.10, 2


def cpu_pressure() -> tuple[float, float] | None:
    """Linux pressure stall information for the CPU: (10 s average share, total seconds) that some task waited."""
    try:
        fields = dict(item.split("=") for item in Path("/proc/pressure/cpu").read_text().split()[1:5])
    except (OSError, ValueError):
        return None  # not Linux, or an old kernel: runs are neither checked nor redone
    return float(fields["avg10"]) / 100, int(fields["total"]) / 1e6


def cpu_waited_s() -> float | None:
    found = cpu_pressure()
    return found[1] if found else None


def wait_for_calm(limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while (found := cpu_pressure()) and found[0] > CALM and time.monotonic() < deadline:
        time.sleep(2)


def measure(args: argparse.Namespace, task: str, steps: int, names: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Run every entry ``args.rounds`` times, in rotated order each round; an entry that cannot run is tried once.

    A run the machine's other work disturbed (see BUSY) is run again, at most REDO times; the last one counts.
    """
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    tuned = Path(tempfile.mkdtemp(prefix="redline-tune-")) if "redline-tuned" in names else None
    if tuned is not None:
        TUNES[task] = tune_once(args.python, task, steps, args.device, tuned, args.tune_budget)
        print(f"  {task}: {TUNES[task]}", flush=True)
    stride = max(1, len(names) // args.rounds)  # spread each entry over the round's positions
    for r in range(args.rounds):
        shift = (r * stride) % len(names)
        for name in names[shift:] + names[:shift]:
            if runs[name] and runs[name][0]["status"] != "ok":
                continue
            for redone in range(REDO + 1):
                wait_for_calm()
                seeded = tuned if name == "redline-tuned" else None
                result = run_entry(args.python, name, task, steps, args.device, args.timeout, seeded)
                result["redone"] = redone
                busy = result.get("cpu_wait")
                shown = f"{result['steady_samples_per_s']:,.0f} samples/s" if result["status"] == "ok" else ""
                waited = "" if busy is None else f" (CPU wait {busy:.0%})"
                print(f"  {task} round {r + 1}/{args.rounds} {name}: {result['status']} {shown}{waited}", flush=True)
                if result["status"] != "ok" or busy is None or busy <= BUSY:
                    break
            runs[name].append(result)
    return runs


def med(values: list[float]) -> float:
    return environment.median(values)


@dataclass(frozen=True)
class Figures:
    """One entry's runs of one task, summed up: medians over rounds, and the fastest run (noise only slows)."""

    rate: float  # steady samples/s, median
    best_rate: float
    loop_s: float
    process_s: float
    best_process_s: float
    final_loss: float
    slowed: int  # runs whose steady rate fell under half the entry's fastest: the machine was busy then

    @classmethod
    def of(cls, ok: list[dict[str, Any]]) -> Figures:
        rates = _rates(ok)
        return cls(
            rate=med(rates),
            best_rate=max(rates),
            loop_s=med([run["loop_s"] for run in ok]),
            process_s=med([run["process_s"] for run in ok]),
            best_process_s=min(run["process_s"] for run in ok),
            final_loss=med([run["final_loss"] for run in ok]),
            slowed=sum(rate < max(rates) / 2 for rate in rates),
        )

    def vs(self, plain: Figures | None) -> tuple[str, str]:
        """Steady and end-to-end ratios to the plain loop (above 1: faster), medians' and fastest runs'."""
        if plain is None:
            return "-", "-"
        steady = f"{self.rate / plain.rate:.2f}x ({self.best_rate / plain.best_rate:.2f}x)"
        whole = f"{plain.process_s / self.process_s:.2f}x ({plain.best_process_s / self.best_process_s:.2f}x)"
        return steady, whole


def task_table(task: str, steps: int, runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The markdown table of one task, then what the runs say about themselves."""
    rows = [
        f"### `{task}`, {steps} steps",
        "",
        "| framework | precision | compile | steps | steady samples/s: median (fastest) | loop s | process s "
        "| steady vs plain: medians (fastest) | end to end vs plain: medians (fastest) | final loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ok = {name: [run for run in done if run["status"] == "ok"] for name, done in runs.items()}
    figures = {name: Figures.of(done) for name, done in ok.items() if done}
    notes, slowed = [], 0
    for entry in [e for e in ENTRIES if e.name in runs]:
        if entry.name not in figures:
            status = runs[entry.name][0]["status"].replace("|", "/")
            rows.append(f"| {entry.label} | {status} | | | | | | | | |")
            continue
        done, fig = ok[entry.name], figures[entry.name]
        steady, whole = fig.vs(figures.get("plain"))
        rows.append(
            f"| {entry.label} | {_each(done, 'precision')} | {_each(done, 'compile')} | {done[0]['steps']} "
            f"| {fig.rate:,.0f} ({fig.best_rate:,.0f}) | {fig.loop_s:.1f} | {fig.process_s:.1f} | {steady} | {whole} "
            f"| {fig.final_loss:.4f} |"
        )
        notes += [f"- {entry.label}'s precision: {why}." for why in sorted({r.get("why") for r in done} - {None})]
        graphs = sorted({r.get("graphs_why") for r in done} - {None})
        notes += [f"- {entry.label}'s CUDA graphs: {why}." for why in graphs]
        slowed += fig.slowed
    for fp32, label in (("accelerate", "Accelerate"), ("fabric", "Fabric"), ("lightning", "the Lightning Trainer")):
        if fp32 in figures and f"{fp32}-bf16" in figures:
            bf16, own = figures[f"{fp32}-bf16"], figures[fp32]
            ratio, best = bf16.rate / own.rate, bf16.best_rate / own.best_rate
            notes.append(f"- {label}'s bf16-mixed ran {ratio:.2f}x its own fp32 (fastest runs: {best:.2f}x).")
    every = [run for done in ok.values() for run in done]
    sums = sorted({run["init_checksum"] for run in every})
    same = "every entry started from the same weights" if len(sums) == 1 else "ENTRIES STARTED FROM DIFFERENT WEIGHTS"
    threads = sorted({run["threads"] for run in every})
    notes.append(f"- {same} (sum of the initial parameters: {', '.join(sums)}); torch threads: {threads}.")
    if task in TUNES:
        notes.append(f"- redline tuned: {TUNES[task]}.")
    notes.append(f"- {slowed} of {len(every)} runs ran under half their entry's fastest steady rate (a busy machine).")
    waits = [run["cpu_wait"] for run in every if run.get("cpu_wait") is not None]
    if waits:
        redone = sum(run["redone"] for run in every)
        notes.append(
            f"- CPU pressure (Linux PSI): some task waited for a CPU during a median {med(waits):.0%} of a counted "
            f"run's time, {max(waits):.0%} at most; {redone} runs were redone for waits over {BUSY:.0%}."
        )
    each = [f"{e.label} {', '.join(f'{r:,.0f}' for r in _rates(ok[e.name]))}" for e in ENTRIES if ok.get(e.name)]
    notes.append(f"- steady samples/s of each run, in the order run: {'; '.join(each)}.")
    return [*rows, "", *notes, ""]


def _rates(runs: list[dict[str, Any]]) -> list[float]:
    return [run["steady_samples_per_s"] for run in runs]


def _each(runs: list[dict[str, Any]], key: str) -> str:
    """One value, or each value with how many rounds ran it (a trial may choose differently from round to round)."""
    shown = ["yes" if run[key] is True else "no" if run[key] is False else str(run[key]) for run in runs]
    if len(set(shown)) == 1:
        return shown[0]
    return ", ".join(f"{value} ({shown.count(value)}/{len(shown)})" for value in sorted(set(shown)))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def default_python() -> str:
    peers = ROOT / ".venv-peers" / "bin" / "python"
    return str(peers) if peers.exists() else sys.executable


def child_versions(python: str) -> str:
    """The versions the children run with (their Python may not be this one)."""
    probe = (
        "import importlib.metadata as m, platform\n"
        "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return 'not installed'\n"
        'print(f\'Python {platform.python_version()}, torch {v("torch")}, accelerate {v("accelerate")}, '
        'lightning {v("lightning")}\')'
    )
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-200:]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(DEFAULT_STEPS), help="comma-separated task specs")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps for every task (default: digits 600, chargpt 300)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frameworks", default=",".join(e.name for e in ENTRIES), help="comma-separated entries")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--python", default=default_python(), help="the children's Python (the peers' venv)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one entry may take")
    parser.add_argument("--tune-budget", type=float, default=120, help="redline tune's --budget for the tuned entry")
    parser.add_argument("--write", default=None, help="write benchmarks/results/NAME.md")
    args = parser.parse_args()
    names = args.frameworks.split(",")
    unknown = sorted(set(names) - {e.name for e in ENTRIES})
    if unknown:
        parser.error(f"unknown framework {unknown[0]!r}; allowed: {', '.join(e.name for e in ENTRIES)}")

    started = time.perf_counter()
    body = [
        f"Children ran with {child_versions(args.python)}. Each entry is its own process; {args.rounds} rounds, the "
        "entries in rotated order each round. Steady samples/s counts the steps after the first 10% (device "
        "synced); loop s runs from the model's first forward to the last optimizer step; process s is the whole "
        "process, launch to exit (imports, setup, redline's precision trial and any compile, with cold caches). "
        "Ratios to the plain loop (above 1: faster than plain) divide the medians, and in brackets the fastest "
        "runs: a busy machine only slows a run, so the fastest run is the least disturbed. "
        "Final loss: the mean of the last 20 steps' losses.",
        "",
    ]
    for task in args.tasks.split(","):
        steps = args.steps or DEFAULT_STEPS.get(task, 300)
        body += task_table(task, steps, measure(args, task, steps, names))
    body += [
        "What each entry runs (every one: seed 0, the Task's optimizer factory and batch size, shuffled data):",
        "",
    ]
    body += [f"- **{e.label}**: {e.ran}." for e in ENTRIES if e.name in names]
    body += ["", f"The whole benchmark took {(time.perf_counter() - started) / 60:.1f} minutes."]
    environment.publish(
        args.write, "The same training under plain PyTorch, Accelerate, Lightning and redline", body, args.device
    )


if __name__ == "__main__":
    main()
