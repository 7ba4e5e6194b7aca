"""Writing a run's results so a crash never leaves a half-written file in place of a good one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from redline.atomic import write_atomic
from redline.errors import ConfigError


def prepare_out_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` if needed and check that it is a writable directory."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"out_dir={str(out)!r} is not a writable directory ({exc.strerror or exc})\n"
            "hint: pass --out to a directory you can write to"
        ) from exc
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, atomically."""
    text = json.dumps(data, indent=2) + "\n"
    write_atomic(path, lambda tmp: _write_text(tmp, text))


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
