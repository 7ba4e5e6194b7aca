"""The weights `redline serve` and `redline predict` load into a model (--weights): a safetensors file, or a checkpoint.

A file that a committed checkpoint's manifest lists is checked against it (size and SHA-256) before it is
read, as a resume checks it: a corrupt one is refused, naming the newest earlier checkpoint that verifies.
A checkpoint directory is taken too: a whole one's ``model.safetensors``, or a sharded (FSDP) one, which
holds no single weights file, read into the plain model in this one process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from torch import nn

from redline.checkpoint.layout import (
    MANIFEST,
    PREFIX,
    Checkpoint,
    CheckpointError,
    check_file,
    find_checkpoints,
    manifest_format,
    read_checkpoint,
    step_of,
)
from redline.checkpoint.shapes import Shapes, differences, safetensors_shapes, shapes_of
from redline.errors import ConfigError

WEIGHTS = "model.safetensors"
SUMMARY = "summary.json"  # beside a run's final weights: its "steps" is theirs
WEIGHTS_HINT = "hint: redline train --out DIR writes DIR/model.safetensors"
FIT_HINT = "hint: pass the weights written by a run of this same model (and the same task options)"
WRAPPED = ("module.", "_orig_mod.")  # the prefixes of a model wrapped by DDP or DataParallel, by torch.compile

log = logging.getLogger("redline")


def load_weights(model: nn.Module, path: Path) -> None:
    """Load a safetensors file, a run's --out (its final model.safetensors) or a checkpoint directory into ``model``;
    a missing file, a corrupt checkpoint or a mismatch is a ConfigError naming it."""
    checkpoint = _checkpoint_holding(path)
    if checkpoint is not None:
        _check_against_manifest(path, checkpoint)
        if checkpoint.sharded:
            _load_sharded(model, path, checkpoint)
            return
        if path.is_dir():  # another of its files (optimizer.pt) is refused below, as any file not of weights
            path = checkpoint.path / WEIGHTS
    if path.is_dir() and (path / WEIGHTS).is_file():  # a run's --out, once the run has finished
        path = _final_weights(path)
    if path.is_dir():
        raise ConfigError(
            f"--weights {str(path)!r} is a directory without a {WEIGHTS} or a {MANIFEST}; expected a .safetensors "
            f"file, a run's --out or a checkpoint directory ({PREFIX}NNNNNNNN)\n{_run_hint(path)}"
        )
    if not path.is_file():
        raise ConfigError(f"--weights {str(path)!r} does not exist\n{_run_hint(path.parent)}")
    _load_file(model, path)


def _final_weights(run: Path) -> Path:
    """A run's --out's final weights, refused where the run went on past them (``_went_past``)."""
    past = _went_past(run)
    if past is None:
        return run / WEIGHTS
    ended, newest = past
    raise ConfigError(
        f"--weights {str(run)!r}: its {WEIGHTS} holds the weights of step {ended} (its {SUMMARY}), but the run went on "
        f"past them: its newest checkpoint holds those of step {newest.step} (resumed, then stopped before it ended, "
        f"or still going)\nhint: pass the ones you mean: --weights {_weights_arg(newest)} (step {newest.step}), "
        f"or --weights {run / WEIGHTS} (step {ended})"
    )


def _went_past(run: Path) -> tuple[int, Checkpoint] | None:
    """Where the run in --out ``run`` went on past its final weights (resumed, then stopped before it wrote its own,
    or still going): the step its summary.json ends at, and its newer newest checkpoint; else None."""
    try:
        ended = json.loads((run / SUMMARY).read_text(encoding="utf-8"))["steps"]
    except (OSError, ValueError, KeyError, TypeError):  # no summary to tell the weights' step by: taken as they are
        return None
    kept = _loadable(run / "checkpoints")
    return (ended, kept[-1]) if isinstance(ended, int) and kept and kept[-1].step > ended else None


def _loadable(root: Path) -> list[Checkpoint]:
    """The checkpoints under ``root`` that --weights can load, oldest first: a sharded one, or one with its weights."""
    return [c for c in find_checkpoints(root) if c.sharded or (c.path / WEIGHTS).is_file()]


def _load_file(model: nn.Module, path: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    try:
        saved = safetensors_shapes(path)
    except SafetensorError as exc:  # not a safetensors file
        raise _unreadable(path, exc) from exc
    model = _holding(model, path, saved)
    _check_fits(model, path, saved, shapes_of(model.state_dict()))
    try:
        load_model(model, str(path), strict=True)
    except SafetensorError as exc:  # a damaged one
        raise _unreadable(path, exc) from exc
    except (RuntimeError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"--weights {str(path)!r} does not fit the model: {first}\n{FIT_HINT}") from exc


def _check_fits(model: nn.Module, path: Path, saved: Shapes, expected: Shapes) -> None:
    found = differences(saved, expected)
    if found:  # named here: torch's own error lists every key of both models
        raise ConfigError(
            f"--weights {str(path)!r} does not fit the model {type(model).__name__}: {'; '.join(found)}\n"
            + (_renamed_hint(path, saved, expected) or _trained_with(path) or FIT_HINT)
        )


def _trained_with(path: Path) -> str:
    """The hint naming the task options of the run that wrote ``path`` (its summary.json's, where the weights are a
    run's final ones or one of its checkpoints), or ""."""
    for run in (path, path.parent, path.parent.parent, path.parent.parent.parent):  # a file, --out, a checkpoint's
        try:
            summary = json.loads((run / SUMMARY).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        options = summary.get("task_options") if isinstance(summary, dict) else None
        if not isinstance(options, dict):
            return ""  # a run's summary from before they were kept, or of a Task built in Python
        given = " ".join(f"--task-arg {key}={value}" for key, value in sorted(options.items()))
        said = f"with {given}" if given else "with no --task-arg (each option the factory's default)"
        task = summary.get("task")
        return f"hint: the run that wrote them ({run / SUMMARY}) loaded its task {task!r} {said}: pass the same"
    return ""


def _holding(model: nn.Module, path: Path, saved: Shapes) -> nn.Module:
    """The module the weights ``saved`` load into: ``model``, or its submodule that holds them all, where every name
    of ``model`` is one of the file's with that submodule's name before it. A wrapper that builds a model's inputs
    (a dict of tensors from the one tensor served) holds the trained model as a child, and the file is the trained
    model's. A prefix of a wrapped model's (DDP's, torch.compile's) is not taken: that model is refused, as before."""
    expected = shapes_of(model.state_dict())
    prefix = _prefix(expected, saved) if saved and expected else ""
    if not prefix.endswith(".") or prefix in WRAPPED:
        return model
    try:
        inner = model.get_submodule(prefix[:-1])
    except AttributeError:
        return model
    log.info(
        "--weights %r holds the weights of %s's submodule %r (%s), every name of the model being one of the "
        "file's with %r before it: loaded into it",
        str(path), type(model).__name__, prefix[:-1], type(inner).__name__, prefix,
    )  # fmt: skip
    return inner


def _load_sharded(model: nn.Module, path: Path, checkpoint: Checkpoint) -> None:
    """Read a sharded checkpoint's weights into ``model``: DCP joins every rank's pieces, without a process group."""
    from redline.checkpoint.sharded import load_sharded_model, saved_shapes

    if path != checkpoint.path:  # one of its files: its shards hold the weights together, none alone
        raise _unreadable(path, None)
    saved = saved_shapes(checkpoint)
    model = _holding(model, path, saved)
    _check_fits(model, path, saved, shapes_of(model.state_dict()))
    try:
        load_sharded_model(checkpoint, model)
    except CheckpointError as exc:
        raise ConfigError(f"--weights {str(path)!r}: {exc}") from exc


def _checkpoint_holding(path: Path) -> Checkpoint | None:
    """The committed checkpoint ``path`` is, or whose manifest lists the file ``path`` (there or not); else None.
    A manifest there that cannot be read is a ConfigError: what it holds cannot be checked."""
    directory = path if path.is_dir() else path.parent
    if not (directory / MANIFEST).is_file() or not _ours(directory):
        return None
    try:
        checkpoint = read_checkpoint(directory)
    except CheckpointError as exc:
        raise ConfigError(
            f"--weights {str(path)!r}: {str(exc).splitlines()[0]}\n"
            f"{_earlier_hint(directory.parent, step_of(directory, {}))}"
        ) from None
    return checkpoint if path.is_dir() or path.name in checkpoint.manifest["files"] else None


def _ours(directory: Path) -> bool:
    """Whether the manifest.json in ``directory`` is a redline checkpoint's: the directory is named as a step's, or
    the manifest names a redline format. Another tool's manifest beside a safetensors file (an export bundle's) is
    not, and the file loads as any other."""
    return directory.name.startswith(PREFIX) or manifest_format(directory) is not None


def _check_against_manifest(path: Path, checkpoint: Checkpoint) -> None:
    """Raise a ConfigError where the files of ``checkpoint`` that the weights are read from differ from its manifest."""
    problem = _problem(checkpoint)
    if problem is not None:
        raise ConfigError(
            f"--weights {str(path)!r}: the checkpoint {checkpoint.path} is corrupt: {problem} (checked against its "
            f"{MANIFEST})\n{_earlier_hint(checkpoint.path.parent, checkpoint.step)}"
        )


def _problem(checkpoint: Checkpoint) -> str | None:
    """What is wrong with the files the weights are read from (a sharded checkpoint's every file), by its manifest."""
    names = sorted(checkpoint.manifest["files"]) if checkpoint.sharded else [WEIGHTS]
    return next(filter(None, (check_file(checkpoint, name) for name in names)), None)


def _earlier_hint(root: Path, step: int) -> str:
    """The fix for a corrupt checkpoint of ``step`` under ``root``: the newest earlier one whose weights verify."""
    for earlier in reversed([c for c in find_checkpoints(root) if c.step < step]):
        if _problem(earlier) is None:
            return (
                f"hint: load the newest earlier checkpoint whose weights verify, of step {earlier.step}: "
                f"--weights {_weights_arg(earlier)}"
            )
    return (
        f"hint: no earlier checkpoint under {root} verifies; pass the run's final weights (redline train --out DIR "
        "writes DIR/model.safetensors when it finishes), or train again"
    )


def _weights_arg(checkpoint: Checkpoint) -> Path:
    """What --weights takes to load ``checkpoint``: a whole one's weights file, a sharded one's directory."""
    return checkpoint.path if checkpoint.sharded else checkpoint.path / WEIGHTS


def _run_hint(run: Path) -> str:
    """The fix for weights asked of directory ``run``: where it is a run's --out that stopped before writing its
    final weights (killed, or failed), its newest checkpoint; else where a run writes them."""
    if _is_sharded(run):  # a file asked of a sharded checkpoint, which holds no model.safetensors
        return f"hint: {run} is a sharded (FSDP) checkpoint, without a {WEIGHTS}: pass it itself: --weights {run}"
    for root, out in ((run / "checkpoints", run), (run, run.parent)):  # the run's --out, or its checkpoints directory
        kept = _loadable(root)
        if not kept:
            continue
        newest = f"its newest checkpoint holds those of step {kept[-1].step}: --weights {_weights_arg(kept[-1])}"
        if not (out / WEIGHTS).is_file():
            return f"hint: the run stopped before writing its final weights; {newest}"
        if _went_past(out) is None:  # a finished run's
            return f"hint: the run's final weights: --weights {out} ({newest})"
        return f"hint: {newest} (the run's final weights, of an earlier step, are {out / WEIGHTS})"
    return WEIGHTS_HINT


def _renamed_hint(path: Path, saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> str:
    """The fix where the same tensors differ only by a prefix of every name ("" where they do not): ``module.``
    of a model saved wrapped in DDP or DataParallel, ``_orig_mod.`` of one saved compiled, in either file."""
    if not saved or not expected:
        return ""
    extra = _prefix(saved, expected)
    if extra:
        strip = f"{{k.removeprefix({extra!r}): v for k, v in load_file({str(path)!r}).items()}}"
        return (
            f"hint: the file's names all start with {extra!r} (a model saved wrapped: DDP's 'module.', "
            f"torch.compile's '_orig_mod.'), the model's do not; save them without it once: python -c \"from "
            f"safetensors.torch import load_file, save_file; save_file({strip}, 'model.safetensors')\""
        )
    missing = _prefix(expected, saved)
    if missing:
        return (
            f"hint: the model's names all start with {missing!r}, the file's do not: the factory wraps the model "
            "(torch.compile, DDP); give the Servable the plain model (the engine compiles it itself, --compile)"
        )
    return ""


def _prefix(longer: dict[str, tuple[int, ...]], shorter: dict[str, tuple[int, ...]]) -> str:
    """The prefix that turns every name of ``shorter`` into ``longer``'s, shapes alike ("" where none does)."""
    first = next(iter(shorter))
    for name in longer:
        if name.endswith(first) and len(name) > len(first):
            prefix = name[: -len(first)]
            if {prefix + key: shape for key, shape in shorter.items()} == longer:
                return prefix
    return ""


def _unreadable(path: Path, exc: Exception | None) -> ConfigError:
    if path.suffix == ".distcp" or path.name == ".metadata" or _is_sharded(path.parent):  # one file of DCP's several
        return ConfigError(
            f"--weights {str(path)!r} is one file of a sharded (FSDP) checkpoint, whose weights its files hold "
            f"together\nhint: pass the checkpoint directory itself: --weights {path.parent}"
        )
    beside = path.parent / WEIGHTS
    if _saved_by_torch(path) and beside.is_file():  # a checkpoint's optimizer.pt, say: its model is beside it
        return ConfigError(
            f"--weights {str(path)!r} was written by torch.save (a pickle), not safetensors: it is not read, as "
            f"unpickling runs code\nhint: pass the model's weights beside it: --weights {beside}"
        )
    if _saved_by_torch(path):  # the commonest mistake: a .pt or .bin file, which safetensors calls a "too large header"
        return ConfigError(
            f"--weights {str(path)!r} was written by torch.save (a pickle), not safetensors: it is not read, as "
            "unpickling runs code\n"
            'hint: convert it once where you trust it: python -c "import torch; from safetensors.torch import '
            f"save_file; save_file(torch.load({str(path)!r}), 'model.safetensors')\" (for a file of the model's "
            "state_dict), then pass --weights model.safetensors"
        )
    return ConfigError(
        f"--weights {str(path)!r} cannot be read as a safetensors file: {exc}\n"
        "hint: pass the model.safetensors that redline train --out DIR wrote, or save with safetensors.torch"
    )


def _is_sharded(directory: Path) -> bool:
    """Whether ``directory`` is a committed sharded checkpoint."""
    try:
        return read_checkpoint(directory).sharded
    except CheckpointError:
        return False


def _saved_by_torch(path: Path) -> bool:
    """Whether ``path`` starts as torch.save writes: a zip archive (torch >= 1.6), or a bare pickle (older, or
    ``_use_new_zipfile_serialization=False``)."""
    try:
        with path.open("rb") as file:
            start = file.read(4)
    except OSError:
        return False
    return start.startswith(b"PK\x03\x04") or (len(start) >= 2 and start[0] == 0x80 and 2 <= start[1] <= 5)
