"""`redline predict`: offline batch inference from one .npy file to another, through the InferenceEngine.

The input is checked against the servable (per-sample shape and dtype) before the model loads onto
the device; the output is written through a temporary file and renamed, so a failure leaves no
half-written file. The engine's Plan is printed, then a summary line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from redline.atomic import write_atomic
from redline.cli.options import (
    EngineCompile,
    EngineDevice,
    EngineGraphs,
    EngineMeasure,
    EnginePrecision,
    ModelSpec,
    TaskArgs,
    Weights,
)
from redline.cli.task_args import parse_task_args
from redline.errors import ConfigError
from redline.render.console import output_console, plan_table
from redline.serve.engine import InferenceEngine
from redline.serve.inputs import NPY_MAGIC, InputSpec, check_array
from redline.serve.refused import Refused
from redline.serve.servable import Servable, load_servable

CHECK_CHUNK = 4096  # samples validated at a time: a large file is not copied whole


def predict(
    spec: ModelSpec,
    input_path: Annotated[Path, typer.Option("--input", metavar="FILE.npy", help="The samples, one per row.")],
    output_path: Annotated[Path, typer.Option("--output", metavar="FILE.npy", help="Where the outputs go.")],
    batch_size: Annotated[int, typer.Option(min=1, help="Samples per batch (the largest bucket).")] = 32,
    weights: Weights = None,
    task_arg: TaskArgs = None,
    device: EngineDevice = "auto",
    precision: EnginePrecision = "auto",
    compile: EngineCompile = "auto",
    cuda_graphs: EngineGraphs = "auto",
    measure: EngineMeasure = "auto",
) -> None:
    """Run a model over a .npy file of samples and write its outputs to another .npy file."""
    check_output(output_path)
    samples = read_samples(input_path)
    servable = load_servable(spec, weights=weights, **parse_task_args(spec, task_arg or []))
    check_samples(samples, servable, input_path)
    engine = InferenceEngine(
        servable, device=device, precision=precision, compile=compile, cuda_graphs=cuda_graphs,
        measure=measure, max_batch_size=batch_size,
    )  # fmt: skip
    console = output_console()
    started = time.perf_counter()
    engine.warm_up()
    warm_s = time.perf_counter() - started
    console.print(plan_table(engine.plan, title=f"Predicting with {servable.name}"))
    outputs, seconds = run_batches(engine, samples, batch_size)
    write_npy(output_path, outputs)
    rate = len(samples) / seconds if seconds > 0 else float("inf")
    console.print(
        f"{len(samples)} samples in {seconds:.2f} s ({rate:,.1f} samples/s; warm-up {warm_s:.1f} s) -> {output_path}",
        highlight=False,
        markup=False,  # a path's `[...]` is text
    )


def check_output(path: Path) -> None:
    """Refuse an output path whose directory is missing, or that names a directory, before any work."""
    if path.is_dir():
        raise ConfigError(f"--output {str(path)!r} is a directory\nhint: name a file, e.g. {path / 'outputs.npy'}")
    if not path.parent.is_dir():
        raise ConfigError(
            f"--output {str(path)!r}: its directory {str(path.parent)!r} does not exist\n"
            f"hint: mkdir -p {path.parent}, or write the outputs elsewhere"
        )


def read_samples(path: Path) -> np.ndarray:
    """Load a .npy array; a missing file, another format or an empty array is a ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"--input {str(path)!r} does not exist\nhint: write the samples with numpy.save(path, array)")
    with path.open("rb") as file:
        magic = file.read(len(NPY_MAGIC))
    if magic != NPY_MAGIC:
        kind = "an .npz archive" if magic.startswith(b"PK") else "not a .npy file"
        raise ConfigError(
            f"--input {str(path)!r} is {kind}: a .npy file starts with numpy's magic bytes\n"
            "hint: write the samples as one array with numpy.save(path, array)"
        )
    try:
        loaded: np.ndarray = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ConfigError(f"--input {str(path)!r} cannot be read as a .npy array: {exc}") from exc
    if loaded.ndim == 0 or len(loaded) == 0:
        raise ConfigError(f"--input {str(path)!r} holds no samples (shape {loaded.shape})")
    if not loaded.dtype.isnative:  # saved on a big-endian machine: torch reads native byte order only
        loaded = loaded.astype(loaded.dtype.newbyteorder("="))
    return loaded


def check_samples(samples: np.ndarray, servable: Servable, path: Path) -> None:
    """Refuse samples whose shape is not (N, *input_shape), or whose dtype does not convert to the input's."""
    expected = servable.input_shape
    if tuple(samples.shape[1:]) != expected:
        raise ConfigError(
            f"--input {str(path)!r}: samples of shape {tuple(samples.shape[1:])} (array {samples.shape}) do not fit "
            f"{servable.name}; expected (N, {', '.join(map(str, expected))})\n"
            "hint: the first dimension counts the samples; each sample has the model's input shape"
        )
    # The server's own checks (dtype kind, integer range, finite floats within the dtype), a chunk at a time.
    spec = InputSpec(expected, servable.input_dtype, max_batch_size=CHECK_CHUNK)
    for start in range(0, len(samples), CHECK_CHUNK):
        try:
            check_array(samples[start : start + CHECK_CHUNK], spec)
        except Refused as refused:
            raise ConfigError(
                f"--input {str(path)!r}: samples {start} to {min(start + CHECK_CHUNK, len(samples)) - 1}: "
                f"{refused.message.split('; expected ')[0]}\n"
                f"hint: save the array as {servable.input_dtype} values the model can take"
            ) from None


def run_batches(engine: InferenceEngine, samples: np.ndarray, batch_size: int) -> tuple[np.ndarray, float]:
    """Run ``samples`` batch by batch with a progress bar on stderr; return the outputs and the seconds taken."""
    parts = []
    bar = Progress(
        TextColumn("predict"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True,
    )  # fmt: skip
    started = time.perf_counter()
    with bar:
        job = bar.add_task("predict", total=len(samples))
        for start in range(0, len(samples), batch_size):
            batch = samples[start : start + batch_size]
            parts.append(engine.predict(batch).numpy())
            bar.advance(job, len(batch))
    return np.concatenate(parts), time.perf_counter() - started


def write_npy(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` as .npy through a temporary file: a crash leaves the old file or none."""

    def write(tmp: Path) -> None:
        with tmp.open("wb") as out:
            np.save(out, array, allow_pickle=False)

    write_atomic(path, write)
