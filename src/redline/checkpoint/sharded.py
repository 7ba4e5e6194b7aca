"""The sharded format: each rank writes its own shards with torch.distributed.checkpoint (DCP).

A checkpoint directory holds DCP's files (``__R_K.distcp`` per rank and ``.metadata``), rank 0's
``runtime.pt`` (loss scaling, every rank's RNG), ``extra.pt`` (the caller's state) and ``plan.json``,
and the manifest. Every rank writes into the staging directory, hashing (SHA-256) its own shards
as DCP writes them, so no file is read back to checksum it; rank 0 checks that it sees every rank's
files (the directory must be on a file system every rank shares: a node-local one is refused),
writes the manifest last and renames the directory into place (layout.py). A failure on rank 0 is raised on
every rank, so none is left waiting.

DCP stores each tensor with its global shape and the piece each rank held, so a checkpoint loads on
a different number of ranks, the pieces redistributed ("load-time resharding":
https://pytorch.org/docs/stable/distributed.checkpoint.html): saved by FSDP2 on N ranks, it loads
into FSDP2 on M ranks, and into a plain unsharded model in a process without a process group. The
state goes through ``get_state_dict`` / ``set_state_dict``, which name every tensor by its
parameter's fully-qualified name whatever the wrapping.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from redline.checkpoint.layout import (
    PLAN,
    SHARDED_FORMATS,
    Checkpoint,
    CheckpointError,
    commit,
    committed_before,
    file_entry,
    legacy_states,
    stage,
    write_failure,
)
from redline.checkpoint.layout import write_json as write_document
from redline.checkpoint.loadable import check_loadable, load_safely
from redline.checkpoint.reading import parsing
from redline.checkpoint.shapes import Shapes, check_same_model, shapes_of
from redline.checkpoint.writing import save_object
from redline.errors import describe_error, few
from redline.parallel.collectives import gather_objects, rank_and_world, run_on_rank0

FORMAT, LEGACY_FORMAT = SHARDED_FORMATS  # redline 0.1's: sizes only, and extra.pt held the whole trainer state
RUNTIME, EXTRA = "runtime.pt", "extra.pt"


def save_sharded(
    final: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    runtime_state: Mapping[str, Any],
    extra: Mapping[str, Any],
    plan: Mapping[str, Any],
    step: int | None,
) -> Checkpoint:
    """Write the checkpoint ``final`` from every rank (collective: each calls it with the same arguments).

    ``runtime_state``, ``extra`` and ``plan`` are rank 0's, in types ``torch.load(weights_only=True)``
    reads back. Returns the committed checkpoint on every rank once it is in place.
    """
    check_loadable(extra)  # on every rank alike, before anything is written
    tmp = run_on_rank0(lambda: stage(final), "preparing the checkpoint directory")
    # An optimizer without state yet gets some from get_state_dict: it steps once with lr=0 (DCP's
    # _init_optim_state), which for Adam counts a step and would change every later update. That
    # state is saved, but dropped again from the live optimizer so the run goes on unchanged.
    fresh = not optimizer.state
    model_state, optimizer_state = get_state_dict(model, optimizer)
    writer = FileSystemWriter(tmp)  # it fsyncs every file it writes (sync_files=True)
    hashing = _HashingFileSystem()
    if isinstance(getattr(writer, "fs", None), FileSystem):  # torch's writer opens its files through .fs
        writer.fs = hashing
    try:
        with _single_process_is_intended():
            dcp.save({"model": model_state, "optimizer": optimizer_state}, storage_writer=writer)
    except CheckpointException as exc:  # DCP gathers every rank's failure and raises it on each
        raise _save_failure(final, tmp, exc, hashing.failure) from None
    if fresh:
        optimizer.state.clear()
    here = _listing(tmp)
    own = {name: entry for name, entry in hashing.entries.items() if here.get(name) == entry["bytes"]}
    views = gather_objects((here, own))  # what every rank sees, and the checksums of what it wrote

    def finish() -> Checkpoint:
        try:
            save_object(dict(runtime_state), tmp / RUNTIME)
            save_object(dict(extra), tmp / EXTRA)
            write_document(tmp / PLAN, plan)
            here = _listing(tmp)
            _check_visible(tmp, here, [listing for listing, _ in views])
            files = {name: entry for _, entries in views for name, entry in entries.items()}
            files.update({name: file_entry(tmp / name) for name in here if name not in files})
            fields = {"world_size": len(views), "fresh_optimizer": fresh}
            return commit(tmp, final, format=FORMAT, step=step, files=files, **fields)
        except OSError as exc:  # a full disk, a quota, storage gone read-only: as the whole format says it
            raise write_failure(final, tmp, exc) from exc

    return run_on_rank0(finish, "committing the checkpoint")


def _save_failure(final: Path, tmp: Path, exc: CheckpointException, failure: OSError | None = None) -> CheckpointError:
    """The error of DCP's write that failed on some rank, raised alike on every rank (DCP's own exception is a
    BaseException holding each rank's traceback): the first failed rank's reason, and no staged part left.
    ``failure``: the OSError of a write this rank's files met, which torch.save (DCP writes tensors through it)
    reports as a RuntimeError ("unexpected pos")."""
    rank, (cause, _) = min(exc.failures.items())
    if rank == rank_and_world()[0] and failure is not None and not isinstance(cause, OSError):
        cause = failure
    remove = rank_and_world()[0] == 0  # every rank is past DCP's last collective: rank 0 removes the part written
    if isinstance(cause, OSError):
        error = write_failure(final, tmp, cause, remove=remove)
    else:
        if remove:
            shutil.rmtree(tmp, ignore_errors=True)
        error = CheckpointError(
            f"{final}: the checkpoint could not be written: rank {rank}: {describe_error(cause)}; the part written "
            f"is removed, and {committed_before(final)}"
        )
    error.__cause__ = cause
    return error


class _HashingFileSystem(FileSystem):
    """DCP's local file system, hashing every file as it is written: no file is read back to checksum it.

    A rank thus checksums its own shards on the way to the disk (SHA-256, in DCP's writer thread);
    a file renamed after writing (DCP's ``.metadata``) is checksummed by rank 0 when it commits.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, dict[str, Any]] = {}
        self.failure: OSError | None = None  # the first write the system refused, named by its file

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashed = _HashingStream(stream)
            try:
                yield hashed  # type: ignore[misc]
            finally:
                if hashed.failure is not None and self.failure is None:
                    code = hashed.failure.errno or errno.EIO
                    self.failure = OSError(code, os.strerror(code), str(path))
            self.entries[Path(path).name] = {"bytes": hashed.size, "sha256": hashed.digest.hexdigest()}


class _HashingStream:
    """A write-only file that hashes what passes through it; DCP writes in order and never seeks back.

    The hash is taken in the writer's thread, on the bytes on their way out: at about 1.8 GB/s a core
    (benchmarks/results/checkpoint-checksums-cpu.md), while each rank hashes only its own shards.
    """

    def __init__(self, raw: io.IOBase) -> None:
        self.raw, self.digest, self.size = raw, hashlib.sha256(), 0
        self.failure: OSError | None = None  # kept: torch.save, writing through this, reports another error

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += view.nbytes
        try:
            return int(self.raw.write(view) or view.nbytes)
        except OSError as exc:
            self.failure = self.failure or exc
            raise

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.raw.close()


def _check_visible(tmp: Path, here: Mapping[str, int], views: list[dict[str, int]]) -> None:
    for rank, view in enumerate(views):
        unseen = sorted(name for name, size in view.items() if here.get(name) != size)
        if unseen:  # a node-local --out: rank 0 would commit a checkpoint without the others' shards
            raise CheckpointError(
                f"rank {rank} wrote {', '.join(unseen)} into {tmp}, and rank 0 does not see it there: the "
                "checkpoint directory must be on a file system every rank shares\n"
                "hint: point --out at shared storage (NFS, Lustre, a cloud file system) mounted on every node"
            )


def _listing(directory: Path) -> dict[str, int]:
    """Return ``{file name: size}`` of the files directly in ``directory`` (empty when it is not there)."""
    if not directory.is_dir():
        return {}
    return {path.name: path.stat().st_size for path in directory.iterdir() if path.is_file()}


def load_sharded(
    checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load ``checkpoint`` into ``model`` and ``optimizer`` in place; return its runtime state and extra state.

    Collective when a process group is initialised: every rank calls it. The model must be wrapped
    (sharded or not) as it will be trained, and the optimizer built on its parameters.
    """
    if not checkpoint.sharded:
        raise CheckpointError(f"{checkpoint.path}: format {checkpoint.format!r} is not a sharded checkpoint")
    fresh = not optimizer.state
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:  # DCP alone would skip the checkpoint's tensors the model lacks, and stop at the first missing one
        check_same_model(checkpoint.path, saved_shapes(checkpoint), shapes_of(model_state))
        _check_same_optimizer(checkpoint, optimizer_state)
    except CheckpointError:
        if fresh:  # get_state_dict gave it DCP's placeholder state: the caller's optimizer is left as it was
            optimizer.state.clear()
        raise
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    try:
        with _single_process_is_intended():
            dcp.load(state, checkpoint_id=checkpoint.path)  # in place, each rank reading the pieces it holds
    except CheckpointException as exc:  # DCP gathers every rank's failure and raises it on each
        rank, (cause, _) = min(exc.failures.items())
        raise CheckpointError(
            f"{checkpoint.path}: the checkpoint could not be loaded: rank {rank}: {describe_error(cause)}\n"
            "hint: if a file of it is gone or damaged, resume from an earlier checkpoint (--resume PATH)"
        ) from cause
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if checkpoint.manifest.get("fresh_optimizer"):  # saved before the first step: its state is DCP's placeholder
        optimizer.state.clear()  # else Adam would count that placeholder step, and every later update differ
    if checkpoint.manifest.get("format") == LEGACY_FORMAT:
        return legacy_states(_load(checkpoint, EXTRA))
    return _load(checkpoint, RUNTIME), _load(checkpoint, EXTRA)


def load_sharded_model(checkpoint: Checkpoint, model: nn.Module) -> None:
    """Load the model's weights of the sharded ``checkpoint`` into the plain ``model``, in one process without a
    process group (DCP reads every rank's pieces into whole tensors); its optimizer state is left unread.

    A checkpoint of another model (a tensor's name or shape) is a CheckpointError before anything is read.
    """
    if not checkpoint.sharded:
        raise CheckpointError(f"{checkpoint.path}: format {checkpoint.format!r} is not a sharded checkpoint")
    state = model.state_dict()
    check_same_model(checkpoint.path, saved_shapes(checkpoint), shapes_of(state))
    try:
        with _single_process_is_intended():
            dcp.load({"model": state}, checkpoint_id=checkpoint.path)  # into the model's own tensors
    except CheckpointException as exc:
        _, (cause, _) = min(exc.failures.items())
        raise CheckpointError(
            f"{checkpoint.path}: the checkpoint's weights could not be read: {describe_error(cause)}"
        ) from cause
    model.load_state_dict(state, strict=True)


def _check_same_optimizer(checkpoint: Checkpoint, live: Mapping[str, Any]) -> None:
    """Raise CheckpointError if the checkpoint lacks state this run's optimizer keeps: another optimizer wrote it.

    DCP would stop at the first key missing, with its own exception (a BaseException) and traceback.
    """
    wanted = [f"state.{name}.{key}" for name, values in live.get("state", {}).items() for key in values]
    wanted += [f"param_groups.{i}.{key}" for i, group in enumerate(live.get("param_groups", ())) for key in group]
    metadata = FileSystemReader(checkpoint.path).read_metadata()
    held = [key.removeprefix("optimizer.") for key in metadata.state_dict_metadata if key.startswith("optimizer.")]
    covered = {".".join(parts[:n]) for parts in (key.split(".") for key in held) for n in range(1, len(parts) + 1)}
    missing = [key for key in wanted if key not in covered]
    if not missing:
        return
    kinds = sorted({key.rsplit(".", 1)[-1] for key in held if key.startswith("state.")})
    keeps = f"keeps {', '.join(kinds)} for a parameter" if kinds else "keeps no state for a parameter"
    raise CheckpointError(
        f"{checkpoint.path}: the checkpoint's optimizer differs from this run's optimizer: missing from the "
        f"checkpoint: {few(missing, 3)} (the checkpoint's optimizer {keeps})\n"
        "hint: the run that wrote it built another optimizer, or the same with other options: build that one "
        "to resume from it"
    )


def saved_shapes(checkpoint: Checkpoint) -> Shapes:
    """Return the whole shapes of the checkpoint's model tensors by name, from DCP's metadata (no shard is read)."""
    with parsing(checkpoint.path / ".metadata"):  # DCP's pickled index of the shards
        metadata = FileSystemReader(checkpoint.path).read_metadata()
    prefix = "model."  # DCP flattens {"model": {name: tensor}} into "model.<name>"
    return {
        key.removeprefix(prefix): tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }


def _load(checkpoint: Checkpoint, name: str) -> dict[str, Any]:
    path = checkpoint.path / name
    if not path.is_file():
        raise CheckpointError(
            f"{checkpoint.path} has no {name}: it was not written by the Runtime or the Trainer\n"
            "hint: resume from a checkpoint that `redline train` or Runtime.save wrote"
        )
    return load_safely(path)


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    # Without a process group DCP warns that it assumes a single process: here that is the contract.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
