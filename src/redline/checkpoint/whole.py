"""The whole format: one process writes the model's weights (safetensors), the optimizer state and the run state.

Used by one device and by DDP (every rank holds the same weights, rank 0 writes them). Files:
``model.safetensors`` (the user's module's names, tied weights once), ``optimizer.pt``,
``runtime.pt`` (loss scaling, every rank's RNG), ``extra.pt`` (the caller's own state, such as the
Trainer's position) and ``plan.json``. Loading never unpickles arbitrary objects: safetensors, and
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from redline.atomic import make_parent, write_or_refuse
from redline.checkpoint.layout import (
    PLAN,
    WHOLE_FORMATS,
    Checkpoint,
    CheckpointError,
    commit,
    file_entry,
    legacy_states,
    stage,
    write_failure,
    write_json,
)
from redline.checkpoint.loadable import check_loadable, load_safely
from redline.checkpoint.reading import parsing
from redline.checkpoint.shapes import Shapes, check_same_model, differences, safetensors_shapes, shapes_of
from redline.checkpoint.writing import save_object, save_tensors
from redline.errors import few

# redline 0.1's first checkpoints: the same files, with trainer.pt for runtime.pt and extra.pt
FORMAT, LEGACY_FORMAT = WHOLE_FORMATS
WEIGHTS, OPTIMIZER, RUNTIME, EXTRA = "model.safetensors", "optimizer.pt", "runtime.pt", "extra.pt"


def save_whole(
    final: Path,
    *,
    module: nn.Module,
    optimizer_state: Mapping[str, Any],
    runtime_state: Mapping[str, Any],
    extra: Mapping[str, Any],
    plan: Mapping[str, Any],
    step: int | None,
) -> Checkpoint:
    """Write a whole checkpoint to ``final`` atomically, from one process."""
    check_loadable(extra)  # before anything is written: a checkpoint that cannot be loaded is none
    tmp = stage(final)
    writers: dict[str, Callable[[Path], None]] = {
        WEIGHTS: lambda path: save_tensors(lambda name: save_model(plain_module(module), name), path),
        OPTIMIZER: lambda path: save_object(dict(optimizer_state), path),
        RUNTIME: lambda path: save_object(dict(runtime_state), path),
        EXTRA: lambda path: save_object(dict(extra), path),
        PLAN: lambda path: write_json(path, plan),
    }
    files = {}
    try:
        for name, write in writers.items():
            write(tmp / name)
            files[name] = file_entry(tmp / name)
    except OSError as exc:  # a full disk, a quota, storage gone read-only: say so, and leave no half of it there
        raise write_failure(final, tmp, exc) from exc
    except Exception:  # a value a writer refused: no half of it is left either
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:  # a run killed once the manifest is written leaves a whole checkpoint, which the next run puts back
        return commit(tmp, final, format=FORMAT, step=step, files=files)
    except OSError as exc:
        raise write_failure(final, tmp, exc) from exc


def read_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Return the checkpoint's weights on the CPU, a tied weight under one of its names."""
    with parsing(checkpoint.path / WEIGHTS):
        return load_file(checkpoint.path / WEIGHTS, device="cpu")


def saved_shapes(checkpoint: Checkpoint) -> Shapes:
    """Return the checkpoint's weights' shapes by name from the file's header, a tied weight under each name."""
    with parsing(checkpoint.path / WEIGHTS):
        return safetensors_shapes(checkpoint.path / WEIGHTS)


def plain_module(module: nn.Module) -> nn.Module:
    """The module under ``torch.compile(model)``'s wrapper, whose weights carry the model's own names: the
    wrapper's all begin with ``_orig_mod.``, and would load into nothing but another compiled wrapper."""
    while isinstance(inner := getattr(module, "_orig_mod", None), nn.Module):
        module = inner
    return module


def _as_saved(checkpoint: Checkpoint, module: nn.Module) -> nn.Module:
    """``module`` under the names the checkpoint holds: its plain module's, or a compiled wrapper's where an
    earlier redline wrote those (``_orig_mod.`` before every name)."""
    saved = saved_shapes(checkpoint)
    if module is not plain_module(module) and not differences(saved, shapes_of(module.state_dict())):
        return module
    return plain_module(module)


def check_model(checkpoint: Checkpoint, module: nn.Module) -> None:
    """Raise CheckpointError if the checkpoint's weights are not ``module``'s, by name and shape."""
    check_same_model(checkpoint.path, saved_shapes(checkpoint), shapes_of(_as_saved(checkpoint, module).state_dict()))


def load_weights(checkpoint: Checkpoint, module: nn.Module) -> None:
    """Load the checkpoint's weights into ``module`` (strict: every name must match), on its own device."""
    check_model(checkpoint, module)
    _load_checked(checkpoint, module)


def load_model_and_optimizer(checkpoint: Checkpoint, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the checkpoint's weights into ``module`` and its optimizer state into ``optimizer``, once both are
    checked: another model is refused as such (it has other groups too), then another kind of optimizer."""
    check_model(checkpoint, module)
    saved = read_optimizer(checkpoint, _device_of(module))
    check_same_optimizer(checkpoint.path, saved, optimizer)  # before the weights change
    _load_checked(checkpoint, module)
    optimizer.load_state_dict(run_as_this_run(saved, optimizer))


# How an optimizer runs, not what it learnt: this run's choice (its Plan's), never the checkpoint's (parallel/fsdp.py
# keeps the same keys for its own loads: the parallel package may not import this one)
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def run_as_this_run(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``saved``, an optimizer state, with each group's implementation keys (``IMPLEMENTATION_KEYS``) those of
    ``optimizer``'s live groups: torch's load would copy the saved ones in, and a fused optimizer given a saved
    ``fused: False`` (a run that stepped as given) steps as given while fp16's scaler hands it a fused step's scale."""
    groups = [
        {**group, **{key: live[key] for key in IMPLEMENTATION_KEYS if key in live}}
        for group, live in zip(saved["param_groups"], optimizer.param_groups, strict=False)
    ]
    return {**saved, "param_groups": groups}


def _load_checked(checkpoint: Checkpoint, module: nn.Module) -> None:
    module = _as_saved(checkpoint, module)
    with parsing(checkpoint.path / WEIGHTS):  # its names and shapes were checked: what fails is the file's bytes
        load_model(module, str(checkpoint.path / WEIGHTS), strict=True, device=str(_device_of(module)))


def _device_of(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def read_optimizer(checkpoint: Checkpoint, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Return the optimizer's ``state_dict()``, its tensors on ``device``."""
    return _load(checkpoint, OPTIMIZER, device)


def check_same_optimizer(
    where: object, saved: Mapping[str, Any], optimizer: torch.optim.Optimizer, *, holder: str = "the checkpoint"
) -> None:
    """Raise CheckpointError if ``saved`` (an optimizer's ``state_dict()``) was written by another kind of optimizer;
    ``where`` names what holds it (a checkpoint's path), which is ``holder``.

    torch's own load takes the saved groups' options in place of the live ones, so Adam's loaded into
    SGD left it without ``momentum``: the first step failed with a KeyError. Options only one side has
    count when both sides have some: a checkpoint of an older or newer torch adds or lacks one or two.
    """
    groups, live = list(saved.get("param_groups", ())), optimizer.param_groups
    sizes, live_sizes = [len(g.get("params", ())) for g in groups], [len(g["params"]) for g in live]
    hint = "the run that wrote it built another optimizer, or the same with other groups: build that one to resume"
    if sizes != live_sizes:
        raise CheckpointError(
            f"{where}: {holder}'s optimizer has parameter groups of {sizes} tensors, this run's "
            f"({type(optimizer).__name__}) of {live_sizes}\nhint: {hint} from it"
        )
    options = {key for group in groups for key in group} - {"params"}
    live_options = {key for group in live for key in group} - {"params"}
    if options - live_options and live_options - options:
        raise CheckpointError(
            f"{where}: {holder}'s optimizer differs from this run's ({type(optimizer).__name__}): it "
            f"has options {few(sorted(options - live_options), 4)} where this one has "
            f"{few(sorted(live_options - options), 4)}\nhint: {hint} from it"
        )


def read_states(checkpoint: Checkpoint) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return the checkpoint's runtime state and the caller's extra state."""
    if checkpoint.manifest.get("format") == LEGACY_FORMAT:
        return legacy_states(_load(checkpoint, "trainer.pt", "cpu"))
    return _load(checkpoint, RUNTIME, "cpu"), _load(checkpoint, EXTRA, "cpu")


def _load(checkpoint: Checkpoint, name: str, device: torch.device | str) -> dict[str, Any]:
    path = checkpoint.path / name
    if not path.is_file():
        raise CheckpointError(f"{checkpoint.path}: {name} is missing\nhint: resume from another checkpoint")
    return load_safely(path, device)


def save_weights_file(path: Path, module: nn.Module) -> None:
    """Save ``module``'s weights as one safetensors file, atomically; tied weights are stored once."""
    _write_weights(path, lambda tmp: save_tensors(lambda name: save_model(plain_module(module), name), tmp))


def save_tensors_file(path: Path, tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> None:
    """Save named tensors (gathered weights, a tied one once) as safetensors, atomically.

    ``aliases`` (``{dropped name: kept name}``) go into the file's metadata the way safetensors'
    ``save_model`` notes them, so ``load_model`` fills the tied names of the plain model.
    """
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    metadata = {"format": "pt", **aliases}
    _write_weights(path, lambda tmp: save_tensors(lambda name: save_file(contiguous, name, metadata=metadata), tmp))


def _write_weights(path: Path, write: Callable[[Path], None]) -> None:
    if path.is_dir():  # else the system's "Is a directory", with a hint about disk space
        raise CheckpointError(
            f"{path} is a directory: the weights are one file\nhint: pass a file's path, e.g. {path / WEIGHTS}"
        )
    hint = "free space on that disk (or make it writable again), then write them again: `redline train` run again "
    hint += "with --resume auto writes them at the end"
    with contextlib.suppress(OSError):  # as a checkpoint's directory is made; where it cannot be, the write says why
        make_parent(path)
    write_or_refuse(path, write, error=CheckpointError, what=": the weights", hint=hint)
