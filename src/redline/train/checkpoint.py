"""Checkpoints that survive a crash at any moment, and resume a run exactly.

A checkpoint is a directory ``checkpoints/step-00000100/`` holding the model's weights as
safetensors (the unwrapped model's names, tied weights once), the optimizer's state, the
trainer's state (LR scheduler, grad scaler, RNG states, data position) and the Plan. It is written
under a temporary name, every file fsynced, a manifest with each file's SHA-256 written last, and
only then renamed into place: a directory without a valid manifest is not a checkpoint. Loading
never unpickles arbitrary objects (safetensors, and torch.load with weights_only=True).

A checkpoint of an FSDP run is the sharded kind that redline.checkpoint.sharded writes (each
rank its shards, the Plan and trainer state beside them), under the same names and with the step in
its manifest: ``find_checkpoints``, ``verify`` and ``open_checkpoint`` take both kinds.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_model
from torch import nn

from redline.atomic import commit_directory, fsync_path
from redline.checkpoint import sharded
from redline.errors import RedlineError
from redline.parallel.collectives import barrier
from redline.parallel.fsdp import load_full_state
from redline.parallel.strategies import unwrap

FORMAT_VERSION = 1
MANIFEST, PREFIX = sharded.MANIFEST, sharded.PREFIX  # one naming for both formats


class CheckpointError(RedlineError):
    """A checkpoint is missing, incomplete or corrupt."""


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint directory and its manifest."""

    path: Path
    step: int
    manifest: dict[str, Any]


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    plan: dict[str, Any],
    keep: int,
) -> Checkpoint:
    """Write a checkpoint for ``step`` under ``root`` atomically; keep only the newest ``keep``."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    writers: dict[str, Callable[[Path], None]] = {
        "model.safetensors": lambda path: save_model(model, str(path)),
        "optimizer.pt": lambda path: torch.save(optimizer.state_dict(), path),
        "trainer.pt": lambda path: torch.save(state, path),
        "plan.json": lambda path: _write_json(path, plan),
    }
    files = {}
    for name, write in writers.items():
        write(tmp / name)
        files[name] = {"sha256": _fsync_and_hash(tmp / name), "bytes": (tmp / name).stat().st_size}
    manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    _fsync_and_hash(tmp / MANIFEST)
    fsync_path(tmp)
    commit_directory(tmp, final)
    for old in find_checkpoints(root)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final, step, manifest)


def save_run(
    root: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    plan: dict[str, Any],
    keep: int,
    sharded_model: bool,
    main: bool,
) -> Checkpoint:
    """Write a run's checkpoint from every rank: sharded (each rank its shards), or whole from rank 0.

    Collective: every rank calls it and returns once the checkpoint is committed, with the same record.
    """
    if sharded_model:
        path = sharded.save_sharded(root, step, model, optimizer, state, keep, documents={"plan.json": plan})
        return Checkpoint(path, step, {})
    written = Checkpoint(root / f"{PREFIX}{step:08d}", step, {})
    if main:
        written = save_checkpoint(
            root, step, model=unwrap(model), optimizer=optimizer, state=state, plan=plan, keep=keep
        )
    barrier()
    return written


def restore_run(
    checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer, *, sharded_model: bool,
    device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """Load a checkpoint's weights and optimizer state into the set-up model; return the trainer's state.

    A sharded checkpoint (an FSDP run's) loads into any strategy on any number of processes, DCP
    redistributing the pieces; a whole one (one device's or DDP's) into an unsharded model, or under
    FSDP each rank reads it whole and keeps its pieces.
    """
    if is_sharded(checkpoint):
        extra = sharded.load_sharded(checkpoint.path, model, optimizer)  # collective: each rank reads its pieces
        if "position" not in extra:
            raise CheckpointError(f"{checkpoint.path}: its extra.pt holds no trainer state; not the Trainer's")
        return extra
    if sharded_model:
        weights = load_file(checkpoint.path / "model.safetensors", device="cpu")
        load_full_state(model, optimizer, weights, load_tensors(checkpoint, "optimizer.pt", torch.device("cpu")))
    else:
        load_weights(checkpoint, unwrap(model))
        optimizer.load_state_dict(load_tensors(checkpoint, "optimizer.pt", device))
    state: dict[str, Any] = load_tensors(checkpoint, "trainer.pt", torch.device("cpu"))
    return state


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def _fsync_and_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb+") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
        os.fsync(handle.fileno())
    return digest.hexdigest()


def find_checkpoints(root: Path) -> list[Checkpoint]:
    """Return the committed checkpoints under ``root`` (readable manifest), oldest first."""
    return [Checkpoint(path, step, manifest) for step, path, manifest in sharded.committed(root)]


def is_sharded(checkpoint: Checkpoint) -> bool:
    """Whether ``checkpoint`` holds per-rank shards (an FSDP run's, redline.checkpoint.sharded)."""
    return checkpoint.manifest.get("format") == sharded.FORMAT


def verify(checkpoint: Checkpoint) -> None:
    """Check every file of ``checkpoint`` against its manifest; raise CheckpointError if one differs."""
    if is_sharded(checkpoint):
        try:
            sharded.check_manifest(checkpoint.path)
        except sharded.ShardedCheckpointError as exc:
            raise CheckpointError(str(exc).split("\n")[0]) from exc
        return
    if checkpoint.manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{checkpoint.path}: format {checkpoint.manifest.get('format')!r}, expected 1")
    for name, entry in checkpoint.manifest["files"].items():
        path = checkpoint.path / name
        if not path.is_file():
            raise CheckpointError(f"{checkpoint.path}: {name} is missing")
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{checkpoint.path}: {name} does not match its checksum (corrupt)")


def open_checkpoint(where: str | Path, root: Path, warn: Callable[[str], None]) -> Checkpoint | None:
    """Return the checkpoint to resume from: ``"auto"`` picks the newest that verifies, else a path.

    A corrupt checkpoint met on the way is reported through ``warn`` and skipped for an older one.
    """
    if str(where) != "auto":
        path = Path(where)
        candidates = [c for c in find_checkpoints(path.parent) if c.path.resolve() == path.resolve()]
        if not candidates:
            raise CheckpointError(
                f"--resume {str(where)!r}: not a checkpoint directory with a manifest\n"
                f"hint: checkpoints live in OUT/checkpoints/step-NNNNNNNN; or pass --resume auto"
            )
        verify(candidates[0])
        return candidates[0]
    for checkpoint in reversed(find_checkpoints(root)):
        try:
            verify(checkpoint)
        except CheckpointError as exc:
            warn(f"skipping a corrupt checkpoint: {exc}")
            continue
        return checkpoint
    return None


def load_weights(checkpoint: Checkpoint, model: nn.Module) -> None:
    """Load the checkpoint's weights into ``model`` (on whatever device it is)."""
    load_model(model, str(checkpoint.path / "model.safetensors"), strict=True, device=_device_of(model))


def load_tensors(checkpoint: Checkpoint, name: str, device: torch.device) -> Any:
    """Load ``optimizer.pt`` or ``trainer.pt`` without unpickling arbitrary objects."""
    return torch.load(checkpoint.path / name, map_location=device, weights_only=True)


def load_plan(checkpoint: Checkpoint) -> dict[str, Any]:
    """Return the Plan the checkpoint was written under, as ``{axis: {"value", "reason"}}``."""
    path = checkpoint.path / "plan.json"
    if not path.is_file():  # e.g. a sharded checkpoint that save_sharded wrote for a loop of the user's own
        raise CheckpointError(
            f"{checkpoint.path} has no plan.json: it was not written by the Trainer\n"
            "hint: resume from a checkpoint the Trainer wrote, or load this one with redline.checkpoint.sharded"
        )
    return dict(json.loads(path.read_text(encoding="utf-8")))


def _device_of(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return str(param.device) if param is not None else "cpu"


def capture_rng() -> dict[str, Any]:
    """Return every RNG state a run draws from, in types that load with weights_only=True."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached": cached},
        "torch": torch.get_rng_state(),
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states ``capture_rng`` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached"])))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
