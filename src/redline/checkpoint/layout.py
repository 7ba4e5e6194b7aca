"""The checkpoint directory both formats share: its name, its manifest, the atomic commit, listing and checks.

A checkpoint is a directory ``step-00000100/``. It is written under ``.tmp-step-00000100/``; when
every file is on disk and fsynced, a manifest with each file's size and SHA-256 is written last and
the directory renamed into place. A directory without a readable manifest is not a checkpoint, so
a crash at any moment leaves the last committed one (and one staged whole, which ``recover`` renames
into place where the crash came between the manifest and the rename). ``verify`` reads every file back against its
manifest; under several processes each rank checks its share of the files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from redline.atomic import ASIDE, commit_directory, fsync_path, recover_directory
from redline.errors import RedlineError, few, nearest
from redline.parallel.collectives import gather_objects, rank_and_world

PREFIX = "step-"
STAGING = ".tmp-"  # a checkpoint being written: .tmp-step-00000100
PRUNED = ".pruned-"  # a checkpoint being removed, renamed out of the run's view first: .pruned-step-00000100
MANIFEST = "manifest.json"
PLAN = "plan.json"
# The formats a manifest may name: whole (one process wrote it) and sharded (every rank its shards),
# each with redline 0.1's first version, which still loads.
WHOLE_FORMATS: tuple[str, int] = ("redline-whole-2", 1)  # (now, redline 0.1's)
SHARDED_FORMATS: tuple[str, str] = ("redline-sharded-2", "redline-sharded-1")
_BLOCK = 1 << 20

log = logging.getLogger("redline")


class CheckpointError(RedlineError):
    """A checkpoint is missing, incomplete or corrupt."""


class FormatError(CheckpointError):
    """A checkpoint in a format this version of redline does not read: another version wrote it."""


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint directory and its manifest."""

    path: Path
    step: int
    manifest: dict[str, Any]
    # The newer checkpoints --resume auto skipped as corrupt to find this one: pruning must not count them.
    skipped: tuple[Checkpoint, ...] = field(default=(), compare=False, repr=False)

    @property
    def format(self) -> str:
        return str(self.manifest.get("format"))

    @property
    def sharded(self) -> bool:
        """Whether each rank wrote its own shards (an FSDP run's) rather than one whole copy."""
        return self.manifest.get("format") in SHARDED_FORMATS


def step_dir(root: Path, step: int) -> Path:
    """Return the directory of ``step``'s checkpoint under ``root``."""
    return root / f"{PREFIX}{step:08d}"


def stage(final: Path) -> Path:
    """Create an empty staging directory for ``final``, one name for every rank (a crashed write's leftovers go).

    What is at ``final`` already is replaced when the checkpoint commits: only a checkpoint (a step
    written again), an empty directory or a run's own step directory may be; anything else is refused
    here, before any file is written.
    """
    _refuse_to_replace(final)
    tmp = final.parent / f"{STAGING}{final.name}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:  # a file where a directory must go, a place nothing may be written: not a traceback
        if exc.errno in (errno.EEXIST, errno.ENOTDIR, errno.ENOENT):
            raise CheckpointError(
                f"{final}: the checkpoint cannot go there: {exc.strerror or exc} ({exc.filename}); nothing was "
                "written\nhint: pass a path in a directory you can write to (a file is in the way, or nothing can "
                "be created there)"
            ) from exc
        raise write_failure(final, tmp, exc) from exc
    return tmp


def _refuse_to_replace(final: Path) -> None:
    """Raise CheckpointError if ``final`` holds what a checkpoint committed there would destroy: the user's files."""
    if not final.exists() and not final.is_symlink():
        return
    if final.is_dir() and not final.is_symlink():
        step = final.name.startswith(PREFIX) and _is_step(final.name.removeprefix(PREFIX))
        other = _other_version(final)  # a newer redline's checkpoint, resumed past by this one: not replaced
        if other is None and (step or (final / MANIFEST).is_file() or not any(final.iterdir())):
            return  # an earlier checkpoint (readable or not), one of the run's step directories, or nothing
        kept = sorted(path.name for path in final.iterdir())
        what = other or f"a directory that is not a checkpoint (no {MANIFEST}; it holds {few(kept, 3)})"
    else:
        what = "a link" if final.is_symlink() else "a file"
    raise CheckpointError(
        f"{final} is {what}, which writing a checkpoint there would replace; nothing was written\n"
        "hint: pass a new directory for the checkpoint (or an earlier checkpoint's, which it replaces), "
        f"or move {final} elsewhere first"
    )


def _other_version(path: Path) -> str | None:
    """What the directory ``path`` holds where it is a checkpoint of another version of redline, else None."""
    found = manifest_format(path)
    if found is not None and _another_version(found):
        return f"a checkpoint of another version of redline (format {found!r})"
    return None


def manifest_format(path: Path) -> object:
    """The format the manifest in directory ``path`` names where it is redline's, of this version or another; None
    without a manifest, with a damaged one, or with another tool's (an export bundle's manifest.json)."""
    with contextlib.suppress(OSError, ValueError):
        found = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        named = found.get("format") if isinstance(found, dict) else None
        if named in (*WHOLE_FORMATS, *SHARDED_FORMATS) or str(named).startswith("redline-"):
            return named
    return None


def _another_version(found: object) -> bool:
    """Whether a manifest's format is one this version does not read, named as redline names its formats."""
    return found not in (*WHOLE_FORMATS, *SHARDED_FORMATS) and str(found).startswith("redline-")


def file_entry(path: Path) -> dict[str, Any]:
    """Return a file's manifest entry, its size and SHA-256, and flush it to disk on the way."""
    with open(path, "rb") as handle:
        digest = _sha256(handle)
        os.fsync(handle.fileno())
    return {"bytes": path.stat().st_size, "sha256": digest}


def _sha256(handle: BinaryIO) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: handle.read(_BLOCK), b""):
        digest.update(block)
    return digest.hexdigest()


def commit(
    tmp: Path, final: Path, *, format: str, step: int | None, files: Mapping[str, Any], **fields: Any
) -> Checkpoint:
    """Write the manifest of the staged ``tmp`` (its files' entries), then rename it to ``final``."""
    manifest = {"format": format, "step": step, **fields, "files": dict(sorted(files.items()))}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    fsync_path(tmp / MANIFEST)
    fsync_path(tmp)
    commit_directory(tmp, final)
    return Checkpoint(final, step_of(final, manifest), manifest)


def write_failure(final: Path, tmp: Path, exc: OSError, *, remove: bool = True) -> CheckpointError:
    """The error of a checkpoint write the system refused; what it had staged under ``tmp`` is removed, where
    ``remove`` (one rank removes it when every rank meets the error at once)."""
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno == errno.ENOENT:  # what was staged is gone: the directory was removed under the write
        # Not removed again: the staging directory there now may be another run's, writing the same step.
        return CheckpointError(
            f"{final}: the checkpoint could not be written: {exc.strerror or exc}{where}: its staging directory was "
            f"removed while it was written, by another run writing checkpoints under {final.parent} (two runs with "
            "one --out) or by hand\nhint: let one run at a time write to an --out (stop the other, or pass each its "
            "own), then run the same command again with --resume auto to continue from the newest checkpoint"
        )
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)
    held = bool(find_checkpoints(final.parent))
    over = "" if held else " (with none, it starts over)"
    return CheckpointError(
        f"{final}: the checkpoint could not be written: {exc.strerror or exc}{where}; the part written is removed, "
        f"and {committed_before(final, held)}\nhint: free space on that disk (or make it writable again), then run "
        f"the same command again with --resume auto to continue from the newest{over}"
    )


def committed_before(final: Path, held: bool | None = None) -> str:
    """What a failed write of checkpoint ``final`` leaves: the checkpoints committed under its folder before it (one
    it was to replace too), or none (a run's first); ``held``: whether there are any, where the caller looked."""
    if held if held is not None else find_checkpoints(final.parent):
        return f"the checkpoints committed before it under {final.parent} are intact"
    return f"no checkpoint was committed before it under {final.parent}"


def write_json(path: Path, document: Mapping[str, Any]) -> None:
    """Write a small JSON document of the checkpoint, readable without torch."""
    path.write_text(json.dumps(document, indent=2), encoding="utf-8")


def read_checkpoint(path: Path) -> Checkpoint:
    """Return the committed checkpoint at ``path``; raise CheckpointError if it has no readable manifest."""
    if not path.exists():  # a mistyped path: not "no readable manifest.json: No such file or directory"
        raise _not_there(path)
    if path.is_file():  # not "no readable manifest.json: Not a directory"
        hint = (
            f"pass the checkpoint directory itself, e.g. {path.parent}"
            if (path.parent / MANIFEST).is_file()
            else (f"pass a directory {PREFIX}NNNNNNNN that holds a {MANIFEST}, or --resume auto")
        )
        raise CheckpointError(f"{path}: a file, where a checkpoint is a directory holding a {MANIFEST}\nhint: {hint}")
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("no files listed")
    except (OSError, ValueError) as exc:
        why = f"no readable {MANIFEST}: {exc}"
        if path.name.startswith(STAGING + PREFIX) and not (path / MANIFEST).exists():
            why = f"a checkpoint was being written there when its run was killed; it has no {MANIFEST}"
        raise CheckpointError(
            f"{path}: not a committed checkpoint ({why})\n"
            f"hint: pass a directory {PREFIX}NNNNNNNN that holds a {MANIFEST}, or --resume auto"
        ) from None
    if manifest.get("format") not in (*WHOLE_FORMATS, *SHARDED_FORMATS):
        known = ", ".join(map(repr, (*WHOLE_FORMATS, *SHARDED_FORMATS)))
        raise (FormatError if _another_version(manifest.get("format")) else CheckpointError)(  # else damaged
            f"{path}: checkpoint format {manifest.get('format')!r} is not one this redline reads ({known})\n"
            "hint: it was written by another version of redline: load it with that version"
        )
    return Checkpoint(path, step_of(path, manifest), manifest)


def _not_there(path: Path) -> CheckpointError:
    """The error of a checkpoint path that does not exist, with the directory beside it that it most likely meant."""
    beside = path.parent.iterdir() if path.parent.is_dir() else ()
    near = nearest(path.name, [p.name for p in beside if p.is_dir() and not p.name.startswith(".")])
    hint = f"pass a directory {PREFIX}NNNNNNNN that holds a {MANIFEST}, or --resume auto"
    if near is not None:
        hint = f"did you mean {path.parent / str(near)}?"
    return CheckpointError(f"{path}: no such checkpoint: nothing is there\nhint: {hint}")


def step_of(path: Path, manifest: Mapping[str, Any]) -> int:
    step = manifest.get("step")
    if isinstance(step, int):
        return step
    digits = path.name.removeprefix(PREFIX)
    return int(digits) if digits.isdigit() else 0


def run_dirs(root: Path) -> list[Path]:
    """The directories under ``root`` named as a run names its checkpoints (``step-NNNNNNNN``), readable or not.

    Any other name is the user's (a copy kept as ``step-00001000-best``, say): never resumed from
    by "auto", never counted, never pruned.
    """
    paths = root.glob(f"{PREFIX}*") if root.is_dir() else ()
    return [path for path in paths if _is_step(path.name.removeprefix(PREFIX)) and path.is_dir()]


def other_versions(root: Path) -> list[int]:
    """The steps of the run's checkpoints under ``root`` that another version of redline wrote, oldest first.

    This version neither resumes from, prunes nor writes over them, and ``find_checkpoints`` leaves them out:
    a run deciding about the checkpoints already there counts them too.
    """
    return sorted(step_of(path, {}) for path in run_dirs(root) if _other_version(path) is not None)


def _is_step(digits: str) -> bool:
    return digits.isascii() and digits.isdigit()


def find_checkpoints(root: Path) -> list[Checkpoint]:
    """Return the run's committed checkpoints under ``root`` (those with a readable manifest), oldest step first."""
    found = []
    for path in run_dirs(root):
        try:
            found.append(read_checkpoint(path))
        except CheckpointError:
            continue  # no manifest: the write never finished
    return sorted(found, key=lambda c: (c.step, c.path))


def prune(root: Path, keep: int, *, corrupt: Collection[Checkpoint] = ()) -> None:
    """Remove all but the newest ``keep`` committed checkpoints under ``root``, and the staging directories left there.

    ``corrupt`` are those a resume found corrupt (``Checkpoint.skipped``): they do not count among the
    ``keep``, so a valid checkpoint is never removed to keep one of them (a resumed run with another
    ``checkpoint_every`` writes steps below them); one older than every checkpoint kept goes with the others.
    Nor does one damaged since it was written (a file missing, or of another size than its manifest says:
    a check of sizes, not checksums, cheap at every checkpoint); it is named in a warning.
    Called by the one process that writes checkpoints under ``root``, after a commit: no write is in progress.
    """
    found = find_checkpoints(root)
    bad = [(c.path, c.manifest) for c in corrupt]  # a step written again since has another manifest: valid
    kept: list[Checkpoint] = []
    for candidate in reversed(found):
        if len(kept) == keep:
            break
        if (candidate.path, candidate.manifest) in bad:
            continue
        damage = next(filter(None, (_check_size(candidate, name) for name in sorted(candidate.manifest["files"]))), "")
        if damage:
            log.warning(
                "%s: %s; it is not counted among the %d checkpoints kept, so an older one is kept in its place",
                candidate.path, damage, keep,
            )  # fmt: skip
            continue
        kept.append(candidate)
    for old in found[: found.index(kept[-1])] if kept else ():
        _remove(old.path)
    if kept:  # one whose manifest no longer reads (damaged since its commit), once the run has gone past it
        listed = {c.path for c in found}
        for path in run_dirs(root):
            if path not in listed and _other_version(path) is None and step_of(path, {}) < kept[-1].step:
                _remove(path)
    clean_staging(root)


def _remove(path: Path) -> None:
    """Remove the checkpoint directory ``path`` as one change a reader sees: renamed out of the run's names first,
    so a run killed amid the removal leaves no half of a checkpoint that still has its manifest (a corrupt one),
    only a ``.pruned-`` directory that ``clean_staging`` removes."""
    doomed = path.with_name(f"{PRUNED}{path.name}")
    try:
        shutil.rmtree(doomed, ignore_errors=True)  # a killed removal's leftover of the same step
        path.rename(doomed)
    except OSError:  # not renamed (a file system that refuses it): removed in place, as before
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)


def clean_staging(root: Path) -> int:
    """Remove the staging directories of writes that never committed (a killed run's) under ``root``, and what a
    killed run's pruning had begun to remove; return how many staging directories.

    Call it only where no checkpoint is being written under ``root``: at the start of the run that
    writes there, or after its commit (``prune`` does), on one rank.
    """
    recover(root)
    leftovers = sorted(path for path in root.glob(f"{STAGING}{PREFIX}*") if path.is_dir()) if root.is_dir() else []
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    pruned = root.glob(f"{PRUNED}{PREFIX}*") if root.is_dir() else ()  # a removal a killed run had begun
    for path in pruned:
        shutil.rmtree(path, ignore_errors=True)
    if leftovers:
        count = f"{len(leftovers)} staging director{'y' if len(leftovers) == 1 else 'ies'}"
        names = ", ".join(path.name for path in leftovers)
        log.info("removed %s of checkpoint writes that never finished under %s: %s", count, root, names)
    return len(leftovers)


def recover(root: Path) -> None:
    """Finish the commits a crash cut short after the manifest was written, under ``root``.

    A replacement (where the system cannot swap two directories): the new one, when its manifest
    was written, takes the step's name; else the older one gets it back. A new step staged whole
    (its manifest written, every file matching it) is renamed into place, as its commit would have
    done; a staged step that is not whole is left for ``clean_staging``. Call it where no checkpoint
    is being written under ``root``, on one rank.
    """
    asides = sorted(path for path in root.glob(f"{ASIDE}{PREFIX}*") if path.is_dir()) if root.is_dir() else []
    for aside in asides:
        name = aside.name.removeprefix(ASIDE).rsplit("-", 1)[0]
        restored = recover_directory(aside, root / f"{STAGING}{name}", lambda tmp: (tmp / MANIFEST).is_file())
        if restored is not None:
            log.warning("put back %s, whose replacement a killed run had not finished", restored)
    staged = sorted(path for path in root.glob(f"{STAGING}{PREFIX}*") if path.is_dir()) if root.is_dir() else []
    for tmp in staged:
        final = root / tmp.name.removeprefix(STAGING)
        if _is_step(final.name.removeprefix(PREFIX)) and not final.exists() and not final.is_symlink() and _whole(tmp):
            tmp.rename(final)
            fsync_path(root)
            log.warning("put back %s: a killed run had written it whole, but not yet renamed it into place", final)


def _whole(tmp: Path) -> bool:
    """Whether the staged checkpoint ``tmp`` is complete: its manifest reads, and every file matches its entry.

    Where a step is written again, the rename that swaps the two may have been cut short after the swap:
    then ``tmp`` holds the older one, whole too, so the caller moves it only where the step's name is free.
    """
    try:
        staged = read_checkpoint(tmp)
    except CheckpointError:  # no manifest yet: the write never finished
        return False
    return bool(staged.manifest["files"]) and not any(check_file(staged, name) for name in staged.manifest["files"])


def verify(checkpoint: Checkpoint) -> None:
    """Check every file of ``checkpoint`` against its manifest's size and SHA-256; raise CheckpointError if one differs.

    Collective under several processes: the files are shared out among the ranks, each reads its
    share, and every rank raises if any file failed, so a sharded checkpoint is read once, not once
    per rank. Manifests of earlier versions without checksums are checked by size.
    """
    rank, world = rank_and_world()
    names = sorted(checkpoint.manifest["files"])
    _agree(checkpoint.path, [p for name in names[rank::world] if (p := check_file(checkpoint, name))])


def _agree(path: Path, problems: list[str]) -> None:
    """Raise on every rank if any rank found a problem with the checkpoint at ``path`` (collective)."""
    problems = [p for share in gather_objects(problems) for p in share]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(
            f"{path}: {problems[0]}{more}\n"
            "hint: the checkpoint is corrupt; resume from an earlier one (--resume auto skips it; in Python, "
            "Trainer(resume='auto'), or rt.load of the one before)"
        )


def _check_size(checkpoint: Checkpoint, name: str) -> str | None:
    """What is wrong with the file ``name`` of ``checkpoint`` that its size shows (missing, truncated), or None."""
    entry = checkpoint.manifest["files"][name]
    path = checkpoint.path / name
    try:
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
    except OSError as exc:
        return f"{name} cannot be read ({exc.strerror or exc})"
    expected = entry.get("bytes") if isinstance(entry, dict) else None
    if expected is None or size == expected:
        return None
    what = "is truncated" if size < expected else "has grown since it was written"
    return f"{name} {what} ({size} bytes where its manifest says {expected})"


def check_file(checkpoint: Checkpoint, name: str) -> str | None:
    sized = _check_size(checkpoint, name)
    if sized is not None:
        return sized
    entry = checkpoint.manifest["files"][name]
    path = checkpoint.path / name
    try:
        expected = entry.get("sha256") if isinstance(entry, dict) else None
        if expected is None:
            return None
        with open(path, "rb") as handle:
            digest = _sha256(handle)
    except OSError as exc:  # reported like any other problem, so the other ranks do not wait for this one
        return f"{name} cannot be read ({exc.strerror or exc})"
    return None if digest == expected else f"{name} does not match its checksum (corrupt)"


def legacy_states(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split the one trainer state of redline 0.1's checkpoints into the runtime's and the Trainer's."""
    rng = state.get("rng_per_rank") or ([state["rng"]] if state.get("rng") is not None else [])
    runtime = {"precision": state.get("scaler") or {}, "rng": rng}
    return runtime, state
