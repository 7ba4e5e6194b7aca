"""What every benchmark result records: the date, the machine and the versions, and where it goes."""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

import redline
from redline.hardware.device import probe_accelerators, probe_device, usable_cpu_count

# A GPU run writes under $OUT so its results travel back; by default they land in results/.
RESULTS = Path(os.environ.get("REDLINE_RESULTS", Path(__file__).parent / "results"))


def describe(device: str = "cpu") -> list[str]:
    """Return markdown lines naming the date, machine and versions of this run."""
    facts = probe_device(torch.device(device))
    found = probe_accelerators()
    lines = [
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {platform.node() or 'unknown'}; {facts.name}; {usable_cpu_count()} usable cores; "
        f"CPU {facts.cpu_isa}{' (faked by REDLINE_CPU)' if facts.cpu_isa_faked else ''}; "
        f"{found.cuda_count} CUDA device(s)",
        f"- device under test: {facts.label} ({facts.name})",
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}, redline {redline.__version__}",
        f"- torch threads: {torch.get_num_threads()}",
        f"- command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
    ]
    if facts.capability:
        lines.insert(3, f"- compute capability: sm{facts.capability[0]}{facts.capability[1]}")
    return lines


def median(values: list[float]) -> float:
    return statistics.median(values)


def write(name: str, title: str, body: list[str], device: str = "cpu") -> Path:
    """Write ``results/<name>.md`` with the environment first; return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    text = "\n".join([f"# {title}", "", *describe(device), "", *body, ""])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def publish(name: str | None, title: str, body: list[str], device: str = "cpu") -> None:
    """Print a result's body; with a ``name`` (a benchmark's --write) also write ``results/<name>.md``."""
    print("\n".join(body))
    if name:
        print(f"wrote {write(name, title, body, device)}")
