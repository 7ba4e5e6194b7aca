"""Writing a run's results so a crash never leaves a half-written file in place of a good one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file, save_model
from torch import nn

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


def save_weights(path: Path, model: nn.Module) -> None:
    """Save ``model``'s weights as safetensors, atomically; tied weights are stored once."""
    write_atomic(path, lambda tmp: save_model(model, str(tmp)))


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Save named tensors (a gathered state dict, tied weights already once) as safetensors, atomically."""
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    write_atomic(path, lambda tmp: save_file(contiguous, str(tmp), metadata={"format": "pt", **(metadata or {})}))
