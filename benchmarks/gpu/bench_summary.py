"""Read the files benchmarks/gpu/bench.sh wrote and print each goal with its measured figure, as markdown.

python benchmarks/gpu/bench_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from redline.render.bench import CACHED_TOLD, TF32_TOLD, TRIAL_CACHED_TOLD, precision_label, shown_name


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {"missing": f"{path.name}: {exc}"}


def goal(name: str, value: float | None, target: float, fmt: str, *, at_most: bool = False) -> str:
    if value is None:
        return f"| {name} | not measured | {fmt.format(target)} | - |"
    met = value <= target if at_most else value >= target
    return f"| {name} | {fmt.format(value)} | {fmt.format(target)} | {'met' if met else 'NOT met'} |"


def bench_lines(out: Path) -> list[str]:
    data = load(out / "bench-digits.json")
    rows = {r["name"]: r for r in data.get("rows", [])}
    lines = ["### bench, digits", "",
             "| row | samples/s | vs naive | p50 ms | compile s | trial s | break-even | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows.values():
        lines.append(
            f"| {shown_name(r)} | {r['samples_per_s'] or 0:,.0f} | {r['speedup_naive'] or 0:.2f}x | "
            f"{r['step_ms_p50'] or 0:.3g} | {_seconds(r, 'compile')} | {_seconds(r, 'trial')} | "
            f"{_num(r['break_even_steps'], '{:,.0f}')} | {r['error']} |"
        )
    return [*lines, *_footnotes(list(rows.values())), ""] if rows else [f"bench: {data.get('missing')}", ""]


def _num(value: float | None, fmt: str) -> str:
    return "" if value is None else fmt.format(value)


def _seconds(row: dict[str, Any], what: str) -> str:
    """A compile's or a trial's seconds, "0.3*" where a cache an earlier process filled served it (as the CLI marks
    them); a bench written before trials were recorded has none."""
    value = row.get(f"{what}_s")
    return "" if value is None else f"{value:.1f}{'*' if row.get(f'{what}_cached') else ''}"


def _footnotes(rows: list[dict[str, Any]]) -> list[str]:
    """What the table's marks mean, as `redline bench` says them under its own."""
    notes = []
    if any(r.get("compile_s") is not None and r.get("compile_cached") for r in rows):
        notes.append(f"- `*` beside a compile's seconds: {CACHED_TOLD}.")
    if any(r.get("trial_s") is not None and r.get("trial_cached") for r in rows):
        notes.append(f"- `*` beside a trial's seconds: {TRIAL_CACHED_TOLD}.")
    if any(precision_label(r) != r.get("precision") for r in rows):
        notes.append(f"- fp32 (TF32): {TF32_TOLD}.")
    return ["", *notes] if notes else []


def logged_tokens(run: Path) -> float | None:
    """The median of the logged windows' tokens/s after the first window (which holds the compile)."""
    try:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except OSError:
        return None
    rates = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    # a row per step, one rate per window: the windows are the runs of equal rates
    windows = [rate for i, rate in enumerate(rates) if i == 0 or rate != rates[i - 1]]
    return statistics.median(windows[1:]) if len(windows) > 1 else None


def main(out: Path) -> None:
    bench = {r["name"]: r for r in load(out / "bench-digits.json").get("rows", [])}
    auto = next((r for r in bench.values() if r["kind"] == "auto"), None)
    gpt2 = load(out / "gpt2-small.json")
    logged = logged_tokens(out / "gpt2-run")
    ratio = gpt2["tokens_per_s"] / logged if logged and gpt2.get("tokens_per_s") else None
    off_by = abs(ratio - 1) if ratio is not None else None
    compiles = re.search(r"compiled (\d+) time", json.dumps(gpt2.get("plan", {})))
    tuned = load(out / "tuned-gpt2-b64.json")
    lines = [
        "| goal | measured | target | |",
        "| --- | --- | --- | --- |",
        goal("digits auto vs naive, steady state (bench)", auto and auto["speedup_naive"], 2.0, "{:.2f}x"),
        goal("GPT-2-small summary tokens/s off the logged windows' median", off_by, 0.10, "{:.1%}", at_most=True),
        goal("GPT-2-small compiles in 300 steps", compiles and float(compiles.group(1)), 1, "{:.0f}", at_most=True),
        goal("tuned GPT-2-small at batch 64, MFU", tuned.get("mfu"), 0.50, "{:.1%}"),
        "",
        *bench_lines(out),
        "### digits, naive vs auto end to end (speedup.py)",
        "",
        "```",
        (out / "speedup-digits.txt").read_text() if (out / "speedup-digits.txt").exists() else "not run",
        "```",
        "",
        f"tuned digits: {load(out / 'tune-digits.json').get('best')}; "
        f"its run: {load(out / 'tuned-digits.json').get('samples_per_s')} samples/s",
        f"tuned GPT-2-small b64: {load(out / 'tune-gpt2-b64.json').get('best')}; "
        f"its run: {tuned.get('tokens_per_s')} tokens/s, MFU {tuned.get('mfu')}",
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
