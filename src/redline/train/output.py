"""Writing a run's results so a crash never leaves a half-written file in place of a good one."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redline.atomic import write_or_refuse
from redline.checkpoint.layout import MANIFEST
from redline.errors import TrainingError, invalid
from redline.train.lock import LOCK
from redline.train.logs import LOG_FILES

if TYPE_CHECKING:
    from redline.runtime.runtime import Runtime

log = logging.getLogger("redline")


def write_results(rt: Runtime, out_dir: Path, summary: dict[str, Any], *, main: bool) -> None:
    """Write the final weights (whole: gathered from the shards under FSDP, so collective) and, on the main rank
    (``main``), the summary."""
    rt.save_weights(out_dir / "model.safetensors")
    if main:
        write_json(out_dir / "summary.json", summary)


def prepare_out_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` if needed and check that it, and the checkpoints folder an earlier run left in it, are
    writable directories: found at the first checkpoint, the steps trained since the last one would be lost."""
    out = Path(path)
    if (out / MANIFEST).is_file():  # --out mistaken for --resume: the run's files would overwrite the checkpoint's
        run = out.parent.parent if out.parent.name == "checkpoints" else out.parent
        raise invalid(
            "out_dir", str(out), "a directory of its own to write the run in; this one is a checkpoint (it holds "
            f"{MANIFEST}), whose model.safetensors the run would replace",
            f"to go on from it: --resume {out} --out {run}",
        )  # fmt: skip
    for where in (out, out / "checkpoints"):
        if where != out and not where.exists():
            continue
        try:
            where.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=where, prefix=".write-check-"):
                pass
        except OSError as exc:
            it = "it" if where == out else f"the {where.name}/ an earlier run left in it"
            why = f"{it} is a file" if where.is_file() else f"writing in {it} failed: {exc.strerror or exc}"
            fix = "e.g. out_dir=runs/NAME" if where == out else f"make {where} a writable directory, or pass another"
            raise invalid("out_dir", str(out), f"a directory to write the run in; {why}", fix) from exc
    check_run_files(out)
    return out


# What a run writes as files in its out_dir (the tensorboard logger writes a folder of its own)
RUN_FILES = (
    "model.safetensors",
    "summary.json",
    *(name for logger, names in LOG_FILES.items() if logger != "tensorboard" for name in names),
)


def check_run_files(out: Path) -> None:
    """Refuse an out_dir where a file of the run's would meet a folder of that name (found only after training, or
    at the first log), or would replace a file of the user's own: one in a directory no redline run has used
    (neither ``checkpoints/`` nor the ``.lock`` every run leaves), whose files are not an earlier run's."""
    folders = [name for name in RUN_FILES if (out / name).is_dir()]
    if folders:
        named = ", ".join(f"{name}/" for name in folders)
        raise invalid(
            "out_dir", str(out), f"a directory the run can write its files in; it holds {named}, a folder where "
            "the run writes a file of that name", f"move {out / folders[0]} out of the way, or pass another --out",
        )  # fmt: skip
    if (out / "checkpoints").exists() or (out / LOCK).exists():  # a redline run's: resumed, or written over
        return
    theirs = [name for name in RUN_FILES if (out / name).exists()]
    if theirs:
        raise invalid(
            "out_dir", str(out), f"a directory of its own for the run; it holds {', '.join(theirs)}, not of a "
            "redline run (it has no checkpoints/ or .lock), which the run would write over",
            f"pass another --out, or move those files out of {out}",
        )  # fmt: skip


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, atomically; a NaN or infinity is written as null (strict JSON)."""
    text = json.dumps(_finite(data), indent=2, allow_nan=False) + "\n"
    hint = "free space on that disk (or make it writable again), then run the same command again with --resume "
    hint += "auto: a run that has ended writes its results again"
    write_or_refuse(path, lambda tmp: _write_text(tmp, text), error=TrainingError, hint=hint)


def read_summary(path: Path) -> dict[str, Any] | None:
    """Return a run's summary.json as data, or None (with a warning) when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s); it will be written again", path, exc)
        return None
    return data if isinstance(data, dict) else None


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
