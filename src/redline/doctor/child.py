"""Run the child process that touches CUDA, with a deadline, and turn its report into facts.

Whatever the child does (hang in a driver call, abort, segfault, print garbage) becomes data here:
the stage it never finished, its exit code, the tail of its stderr. A child stuck in the driver past
the deadline is killed; one that cannot even be killed (uninterruptible sleep in the kernel) is
abandoned rather than waited for.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redline.doctor.snapshot import ChildRun, Measurement, Snapshot, TorchFacts, load_fields

CHILD_SCRIPT = Path(__file__).with_name("torch_child.py")
MARKER = "@redline-doctor "  # the same as torch_child.MARKER, which this process never imports
DEFAULT_TIMEOUT_S = 45.0  # starting CUDA on eight GPUs and measuring each takes well under this
KILL_WAIT_S = 5.0


@dataclass
class ChildReport:
    """The stages the child reported, in order."""

    stages: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage -> its last line
    begun: list[str] = field(default_factory=list)


class Child:
    """The child process, started first so that it imports torch while this process probes the rest."""

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, script: Path = CHILD_SCRIPT) -> None:
        self.timeout_s = timeout_s
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            encoding="utf-8",
            errors="replace",  # a library's message in another encoding must not cost the child's whole report
        )

    def wait(self) -> tuple[ChildReport, ChildRun]:
        """Wait until the child ends or its deadline passes; return what it reported and how it ended."""
        timed_out = False
        try:
            out, err = self.proc.communicate(timeout=max(0.0, self.timeout_s - self.elapsed()))
        except subprocess.TimeoutExpired as first:
            timed_out = True
            self.proc.kill()
            try:
                out, err = self.proc.communicate(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # stuck in the kernel: keep what it printed and move on
                out, err = _text(first.output), _text(first.stderr)
        report = parse_lines(out)
        run = ChildRun(
            exit_code=self.proc.poll(),
            timed_out=timed_out,
            timeout_s=self.timeout_s,
            seconds=round(self.elapsed(), 2),
            unfinished_stage=next((s for s in report.begun if report.stages[s]["status"] == "begin"), None),
            stderr_tail=err[-2000:],
        )
        return report, run

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data or ""


def parse_lines(out: str) -> ChildReport:
    """Collect the child's protocol lines; anything else on stdout is ignored."""
    report = ChildReport()
    for line in out.splitlines():
        if not line.startswith(MARKER):
            continue
        try:
            entry = json.loads(line[len(MARKER) :])
            stage = str(entry["stage"])
        except (ValueError, KeyError, TypeError):
            continue
        if stage not in report.stages:
            report.begun.append(stage)
        report.stages[stage] = entry
    return report


def apply_report(snapshot: Snapshot, report: ChildReport, run: ChildRun) -> None:
    """Fill the snapshot's torch facts and measurements from the child's report."""
    snapshot.child = run
    imported = report.stages.get("import")
    if imported is None or imported["status"] == "begin":
        return  # torch never finished importing: the child run says why
    if imported["status"] == "error":
        snapshot.torch = TorchFacts(import_error=imported.get("error"))
        return
    torch: dict[str, Any] = dict(imported.get("facts", {}))
    cuda = report.stages.get("cuda")
    if cuda is not None and cuda["status"] != "begin":
        torch["warnings"] = cuda.get("warnings", [])
        if cuda["status"] == "done":
            torch.update(cuda.get("facts", {}))
        else:
            torch.update(cuda_available=False, cuda_error=cuda.get("error"))
    snapshot.torch = load_fields(TorchFacts, torch, "child:import")
    for stage in report.begun:
        entry = report.stages[stage]
        if stage in ("cpu", "mps") or stage.startswith("cuda:"):
            if entry["status"] == "done":
                snapshot.measurements.append(load_fields(Measurement, entry.get("facts"), f"child:{stage}"))
            elif entry["status"] == "error":
                snapshot.measurements.append(Measurement(device=stage, error=entry.get("error")))
