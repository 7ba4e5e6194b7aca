"""What every benchmark result records: the date, the machine and the versions, and where it goes."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

import redline
from redline.hardware.device import probe_accelerators, probe_device, usable_cpu_count
from redline.plan.precision import fast_precisions

ROOT = Path(__file__).resolve().parent.parent
# A GPU run writes under $OUT so its results travel back; by default they land in results/.
RESULTS = Path(os.environ.get("REDLINE_RESULTS", Path(__file__).parent / "results"))
CACHES = ("TORCHINDUCTOR_CACHE_DIR", "REDLINE_CACHE_DIR")  # torch's compile caches; redline's trials and tunes


def exit_without_cpu_trials() -> None:
    """Exit, saying why, where auto's trial has no reduced precision to time on this CPU: a script timing trials
    would have nothing to time."""
    if not fast_precisions(probe_device(torch.device("cpu"))):
        raise SystemExit("this CPU has no bf16 arithmetic: auto runs no trial here, there is nothing to time")


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
        f"- commit: {git_commit()}",
        f"- caches: {caches(os.environ)}",
        f"- command, from the repository root: `{command_line(sys.argv, os.environ, Path.cwd())}`",
    ]
    if facts.capability:
        lines.insert(3, f"- compute capability: sm{facts.capability[0]}{facts.capability[1]}")
    return lines


def git_commit(root: Path = ROOT) -> str:
    """The checkout's commit, marked where tracked files differ from it; "unknown" outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout, or no git)"
    return f"{head} plus uncommitted changes" if dirty else head


def caches(env: Mapping[str, str]) -> str:
    """Where this process's compile and trial caches live: a folder set for the run, or the default kept between runs.

    A benchmark whose children each get fresh caches (``fresh_caches``) says so in its own notes.
    """
    defaults = {"TORCHINDUCTOR_CACHE_DIR": "torch's default under /tmp", "REDLINE_CACHE_DIR": "~/.cache/redline"}
    said = [
        f"{name}={env[name]}" if env.get(name) else f"{name} unset ({defaults[name]}, kept between runs)"
        for name in CACHES
    ]
    return "; ".join(said)


def command_line(argv: Sequence[str], env: Mapping[str, str], cwd: Path, root: Path = ROOT) -> str:
    """The command as one types it in the repository root: the script's path and PYTHONPATH made relative to it."""

    def from_root(path: str) -> str:
        full = (cwd / path).resolve()
        return str(full.relative_to(root)) if full.is_relative_to(root) else str(full)

    words = [from_root(argv[0]), *argv[1:]]
    pythonpath = ":".join(from_root(part) for part in env.get("PYTHONPATH", "").split(os.pathsep) if part)
    prefix = f"PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
    return f"{prefix}python {shlex.join(words)}"


@contextlib.contextmanager
def fresh_caches() -> Iterator[dict[str, str]]:
    """An environment for one child process: empty compile and trial caches, removed after, and this checkout's src/.

    Each timed run in its own process with its own caches pays its own cold compile, trial and tune, as a user's
    first run does: nothing one run cached (torch's FX graphs and AOTAutograd entries, a measured trial, a tuned
    Plan) reaches the next.
    """
    with tempfile.TemporaryDirectory(prefix="redline-bench-") as folder:
        path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
        yield {
            **os.environ,
            "PYTHONPATH": path,
            "TORCHINDUCTOR_CACHE_DIR": str(Path(folder) / "inductor"),
            "REDLINE_CACHE_DIR": str(Path(folder) / "redline"),
        }


def table_page(doc: str, settings: str, header: Sequence[str], rows: Sequence[str]) -> list[str]:
    """A result's body: what the script measures (its docstring's second paragraph), a line of its settings, and a
    table of ``header`` (the columns' names) and ``rows`` (markdown lines)."""
    return [
        doc.split("\n\n")[1].replace("\n", " "),
        "",
        settings,
        "",
        f"| {' | '.join(header)} |",
        f"|{' --- |' * len(header)}",
        *rows,
    ]


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
