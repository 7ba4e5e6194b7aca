"""Sharded checkpoints: each rank writes its own shards with torch.distributed.checkpoint (DCP).

A checkpoint is a directory ``step-00000100/`` holding DCP's files (one ``__R_0.distcp`` per rank and
``.metadata``), ``extra.pt`` (the trainer's small state, from rank 0) and ``manifest.json``. The commit
is atomic as in the single-process format (train/checkpoint.py): every rank writes into
``.tmp-step-00000100/``, then tells rank 0 which files it sees there; rank 0 checks that it sees
them too (the directory must be on a file system every rank shares: a node-local one is refused),
writes the manifest last and renames the directory into place. A failure on rank 0 is passed to
every rank, so none is left waiting. A directory without a valid manifest is not a checkpoint. The
manifest records each file's size, not a checksum (DCP's shards can be large): a truncated or
missing shard is caught, a flipped bit inside one is not.

DCP stores each tensor with its global shape and the piece each rank held, so a checkpoint loads on
a different number of ranks, the pieces redistributed ("load-time resharding":
https://pytorch.org/docs/stable/distributed.checkpoint.html). The contract, tested: saved by FSDP2 on
N ranks, it loads into FSDP2 on M ranks (2 -> 1, 1 -> 2; one rank means a 1-rank process group), and
into a plain unsharded model in a process without a process group. The model and optimizer state go
through ``get_state_dict`` / ``set_state_dict``, which name every tensor by its parameter's
fully-qualified name whatever the wrapping, so the state is not tied to how the model was wrapped.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from redline.atomic import commit_directory, fsync_path
from redline.errors import RedlineError, invalid
from redline.parallel.collectives import gather_objects

FORMAT = "redline-sharded-1"
MANIFEST = "manifest.json"
PREFIX = "step-"  # the naming of both checkpoint formats (train/checkpoint.py uses these two)
EXTRA = "extra.pt"


class ShardedCheckpointError(RedlineError):
    """A sharded checkpoint is missing, incomplete or corrupt."""


def save_sharded(
    path_root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int,
    *,
    documents: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` under ``path_root`` from every rank; keep the newest ``keep``.

    Every rank must call it (it is collective) with the same ``path_root`` and ``step``. ``extra`` is
    rank 0's: tensors and primitives that ``torch.load(weights_only=True)`` reads back. ``documents``
    are rank 0's JSON files to write beside it (``{"plan.json": {...}}``), readable without torch.
    Returns the committed directory once every rank may see it.
    """
    if not isinstance(keep, int) or keep < 1:
        raise invalid("keep", keep, "a positive integer (the newest checkpoints to keep)")
    final = path_root / f"{PREFIX}{step:08d}"
    tmp = path_root / f".tmp-{final.name}"  # one name for all ranks, so no process id in it
    _on_rank0(lambda: _prepare(tmp))
    # An optimizer without state yet gets some from get_state_dict: it steps once with lr=0 (DCP's
    # _init_optim_state), which for Adam counts a step and would change every later update. That
    # state is saved, but dropped again from the live optimizer so the run goes on unchanged.
    fresh = not optimizer.state
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # DCP's file writer fsyncs each file it writes (FileSystemWriter's sync_files=True).
    with _single_process_is_intended():
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
    if fresh:
        optimizer.state.clear()
    views = gather_objects(_listing(tmp))  # what every rank sees of the directory, once its shards are on disk
    _on_rank0(lambda: _commit(tmp, final, step, extra, documents or {}, views, keep))
    return final  # every rank returns after the rename: none goes on to load it, or save again, before


def _prepare(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
    tmp.mkdir()


def _commit(
    tmp: Path, final: Path, step: int, extra: dict[str, Any], documents: Mapping[str, Any],
    views: list[dict[str, int]], keep: int,
) -> None:  # fmt: skip
    """On rank 0: write the small files, check every rank's shards are here, write the manifest, rename."""
    torch.save(extra, tmp / EXTRA)
    fsync_path(tmp / EXTRA)
    for name, document in documents.items():
        (tmp / name).write_text(json.dumps(document, indent=2), encoding="utf-8")
        fsync_path(tmp / name)
    here = _listing(tmp)
    for rank, view in enumerate(views):
        unseen = sorted(name for name, size in view.items() if here.get(name) != size)
        if unseen:  # a node-local --out: rank 0 would commit a checkpoint without the others' shards
            raise ShardedCheckpointError(
                f"rank {rank} wrote {', '.join(unseen)} into {tmp}, and rank 0 does not see it there: the "
                "checkpoint directory must be on a file system every rank shares\n"
                "hint: point --out at shared storage (NFS, Lustre, a cloud file system) mounted on every node"
            )
    files = {name: {"bytes": size} for name, size in sorted(here.items())}
    manifest = {"format": FORMAT, "step": step, "world_size": len(views), "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    fsync_path(tmp / MANIFEST)
    fsync_path(tmp)
    commit_directory(tmp, final)
    for _, old, _ in committed(final.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _listing(directory: Path) -> dict[str, int]:
    """Return ``{file name: size}`` of the files directly in ``directory`` (empty when it is not there)."""
    if not directory.is_dir():
        return {}
    return {path.name: path.stat().st_size for path in directory.iterdir() if path.is_file()}


def _on_rank0(action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0; every rank waits for it and raises if it failed, so none is left waiting."""
    if not dist.is_initialized():
        action()
        return
    error = None
    if _rank() == 0:
        try:
            action()
        except Exception as exc:  # passed to every rank, then raised there
            error = f"{type(exc).__name__}: {exc}"
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ShardedCheckpointError(f"saving the checkpoint failed on rank 0: {box[0]}")


def load_sharded(checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a committed checkpoint into ``model`` and ``optimizer`` in place; return its ``extra``.

    Collective when a process group is initialised: every rank calls it. The model must be wrapped
    (sharded or not) as it will be trained, and the optimizer built on its parameters.
    """
    check_manifest(checkpoint_dir)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=checkpoint_dir)  # in place, each rank reading the pieces it holds
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    extra: dict[str, Any] = torch.load(checkpoint_dir / EXTRA, map_location="cpu", weights_only=True)
    return extra


def check_manifest(path: Path) -> None:
    """Check that ``path`` is a committed sharded checkpoint with every file whole; else raise."""
    try:
        manifest: dict[str, Any] = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ShardedCheckpointError(
            f"{path}: no readable {MANIFEST}, so not a committed checkpoint ({exc})\n"
            f"hint: pass a directory {PREFIX}NNNNNNNN that save_sharded committed"
        ) from exc
    if manifest.get("format") != FORMAT:
        raise ShardedCheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    # DCP keeps no checksums; a size check catches the truncated or missing shard a lost node leaves.
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            raise ShardedCheckpointError(f"{path}: {name} is missing or truncated")


def committed(root: Path) -> list[tuple[int, Path, dict[str, Any]]]:
    """Return ``(step, directory, manifest)`` of each committed checkpoint under ``root``, oldest step first.

    Both formats commit this way, so train/checkpoint.py lists its checkpoints through it too.
    """
    found = []
    for path in root.glob(f"{PREFIX}*") if root.is_dir() else ():
        try:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
            found.append((int(manifest["step"]), path, manifest))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no manifest: the write never finished
    return sorted(found, key=lambda entry: entry[:2])


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    # Without a process group DCP warns that it assumes a single process: here that is the contract.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
