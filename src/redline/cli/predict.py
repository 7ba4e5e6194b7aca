"""`redline predict`: offline batch inference from one .npy file to another, through the InferenceEngine.

The input is memory-mapped (read from disk a batch at a time, so a file larger than memory runs)
and checked against the servable (per-sample shape and dtype) before the model loads onto the
device; the outputs are written batch by batch (as large as the input, they need no more memory)
through a temporary file that is renamed at the end, so a failure leaves no half-written file. The
engine's Plan is printed, then a summary line. An exception the model raises (in the warm-up, or
on a batch of the input) is an InferenceError naming the rows it ran, the
line of the user's code and what to check; one that redline's own code raised is not blamed on
the model, and ends the command with its traceback.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, BinaryIO

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from redline.atomic import check_output, read_head, refuse_replacing, write_atomic
from redline.cli.options import (
    ENGINE_FLAGS,
    EngineCompile,
    EngineDevice,
    EngineGraphs,
    EngineLayout,
    EngineMeasure,
    EnginePrecision,
    ModelSpec,
    TaskArgs,
    Weights,
    count,
    given_file,
    given_path,
    said_by_flags,
)
from redline.cli.signals import stopped_by_signal
from redline.cli.task_args import load_given_servable
from redline.errors import (
    ConfigError,
    InferenceError,
    RedlineError,
    ServableError,
    describe_error,
    invalid,
    wrapping_errors,
)
from redline.plan import Choice
from redline.plan.inference import MIXED_OF
from redline.render.console import output_console, plan_table, print_uncut, result_out, transient_bar
from redline.runtime.contract import blames_user_code, user_line
from redline.runtime.oom import is_oom
from redline.serve.engine import InferenceEngine
from redline.serve.inputs import FIRST_IN_SAMPLE, NPY_MAGIC, InputSpec, check_array
from redline.serve.options import check_engine_options
from redline.serve.refused import Refused
from redline.serve.runners import WEIGHT_DTYPES
from redline.serve.servable import Servable, as_model_spec, shape_text

CHECK_CHUNK = 4096  # samples validated at a time: a large file is not copied whole
ROWS_CHECK = "check those rows' values"  # the hint's start when the model raised on a batch


def predict(
    spec: ModelSpec,
    input_path: Annotated[
        Path, typer.Option("--input", metavar="FILE.npy", parser=given_path, help="The samples, one per row.")
    ],
    output_path: Annotated[
        Path,
        typer.Option("--output", metavar="FILE.npy", parser=_output_file, help="Where the outputs go (- for stdout)."),
    ],
    batch_size: Annotated[int, count("Samples per batch (the largest bucket; at most the samples in --input).")] = 32,
    weights: Weights = None,
    task_arg: TaskArgs = None,
    device: EngineDevice = "auto",
    precision: EnginePrecision = "auto",
    compile: EngineCompile = "auto",
    cuda_graphs: EngineGraphs = "auto",
    measure: EngineMeasure = "auto",
    channels_last: EngineLayout = "auto",
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the plan and the summary as JSON on stdout (no table).")
    ] = False,
) -> None:
    """Run a model over a .npy file of samples and write its outputs to another .npy file."""
    with said_by_flags(**ENGINE_FLAGS):  # a bad engine flag is told before the model loads, by its flag
        check_engine_options(
            device=device, precision=precision, compile=compile, cuda_graphs=cuda_graphs, measure=measure,
            channels_last=channels_last,
        )  # fmt: skip
    samples = read_samples(input_path)
    check_output(output_path, "--output", "outputs.npy")  # after the input: a mistyped --input makes no directory
    to_stdout = same_as_stdout(output_path)  # --output /dev/stdout | consumer: the table would go into the array
    if to_stdout and json_output:
        raise ConfigError(
            f"--output {str(output_path)!r} is stdout, where --json prints too: the two would mix in one stream\n"
            "hint: drop --json (the plan and the summary then go to stderr), or write the outputs to a file"
        )
    if to_stdout and result_out().isatty():  # the array's bytes would print as noise, and a terminal alters them
        raise ConfigError(
            f"--output {str(output_path)!r} is stdout, which is a terminal: the .npy array is binary\n"
            "hint: pipe it (`| consumer`) or redirect it (`> outputs.npy`), or name a file: --output outputs.npy"
        )
    code_file = Path(spec.rsplit(":", 1)[0]) if spec.rsplit(":", 1)[0].endswith(".py") else None
    kept = [(input_path, "the --input file", "the samples"), (weights, "the --weights file", "the model's weights"),
            (code_file, f"the file of {spec}", "the model's code")]  # fmt: skip
    for path, named, what in kept:
        if path is not None and output_path.exists() and path.exists() and output_path.samefile(path):  # a link too
            raise ConfigError(
                f"--output {str(output_path)!r} is {named}: the outputs would replace {what}\n"
                f"hint: write the outputs to another file, e.g. --output {output_path.with_suffix('.out.npy')}"
            )
    # Swapping --weights and --output, or a slip of the tab key, names a file of the user's: an earlier run's outputs
    # are replaced, anything else would be lost.
    refuse_replacing(output_path, "--output", kind=".npy array", holds=_is_npy, example="outputs.npy")
    with stopped_by_signal("loading the model", NOT_WRITTEN):  # which can take minutes, compiles included
        with as_model_spec(spec):  # not a task spec, as the loader would say
            servable = load_given_servable(spec, task_arg, weights, stdout_kept=json_output or to_stdout)
        check_samples(samples, servable, input_path)
        batch_size = min(batch_size, len(samples))  # no bucket larger than the file is warmed up (or compiled)
        warming = "warming up, before any row of --input ran (on zeros of the Servable's input shape)"
        with model_raising(warming, check_hint(servable, precision=precision)), said_by_flags(**ENGINE_FLAGS):
            # One bucket: every row runs in one setting, at one batch shape (the last batch padded up), so a sample
            # gets the same outputs whatever its row; a server's smaller buckets (a second setting, split off for
            # light load) would run the last partial batch another way.
            building = time.perf_counter()  # the settings' timing, where measured, is part of the set-up
            engine = InferenceEngine(
                servable, device=device, precision=precision, compile=compile, cuda_graphs=cuda_graphs,
                measure=measure, channels_last=channels_last, max_batch_size=batch_size, batch_buckets=(batch_size,),
                planned_batches=math.ceil(len(samples) / batch_size),
            )  # fmt: skip
            engine.plan["buckets"] = Choice(
                [batch_size], "the batch size alone: every row runs in one setting at one shape, the last batch padded"
            )
            started = time.perf_counter()
            engine.warm_up()
            warm_s, setup_s = time.perf_counter() - started, time.perf_counter() - building
    console = Console(stderr=True) if to_stdout else output_console()  # stdout carries the array
    if not json_output:
        print_uncut(console, plan_table(engine.plan, title=f"Predicting with {servable.name}"))
    source, hint = f"--input {str(input_path)!r}", check_hint(servable, samples, precision=precision)
    first: list[tuple[tuple[int, ...], np.dtype]] = []  # one sample's output shape and dtype, as the file has them

    def run(emit: Callable[[np.ndarray], None]) -> float:
        def kept(outputs: np.ndarray) -> None:
            first[:] = first or [(outputs.shape[1:], outputs.dtype)]
            emit(outputs)

        return run_batches(engine, samples, batch_size, source, hint, kept)

    with stopped_by_signal("predicting", NOT_WRITTEN):  # the temporary file of the outputs goes with the run
        seconds = write_outputs(output_path, len(samples), run)
    rate = len(samples) / seconds if seconds > 0 else None
    if json_output:
        summary = {
            "model": servable.name, "input": str(input_path), "output": str(output_path), "samples": len(samples),
            "output_shape": [len(samples), *first[0][0]], "output_dtype": str(first[0][1]),
            "seconds": seconds, "samples_per_s": rate, "warm_up_s": warm_s, "setup_s": setup_s,
            "batch_size": batch_size,
            "plan": engine.plan_dict(),
        }  # fmt: skip
        print(json.dumps(summary, indent=2), file=result_out())
        return
    console.print(
        f"{len(samples)} samples in {seconds:.2f} s ({rate or math.inf:,.1f} samples/s; set-up {setup_s:.1f} s, "
        f"warm-up {warm_s:.1f} s of it) -> "
        f"{output_path}",
        highlight=False,
        markup=False,  # a path's `[...]` is text
        soft_wrap=True,  # in a log or pipe the line is whole, `-> PATH` never broken; a terminal wraps it
    )


def _output_file(text: str | Path) -> Path:
    """``--output``'s value: a file, or ``-``, stdout (as ``/dev/stdout``), where the array alone goes."""
    if str(text) != "-":
        return given_file("outputs.npy")(text)
    stdout = Path("/dev/stdout")
    if not stdout.exists():
        raise invalid("path", "-", "a file: this system has no /dev/stdout", "name a file, e.g. outputs.npy")
    return stdout


def same_as_stdout(path: Path) -> bool:
    """Whether ``path`` is the file this process's stdout writes to (``/dev/stdout``, ``/dev/fd/1``)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(result_out().fileno()))  # not stderr, where --json sent it
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # no such file yet, or no real stdout
        return False


def read_samples(path: Path) -> np.ndarray:
    """Load a .npy array; a missing file, another format or an empty array is a ConfigError naming the file."""
    if path.is_dir():
        raise ConfigError(f"--input {str(path)!r} is a directory\nhint: name the .npy file of the samples inside it")
    if path.exists() and not path.is_file():  # /dev/stdin, <(cmd): numpy reads a .npy by seeking back in it
        raise ConfigError(
            f"--input {str(path)!r} is a pipe or a device, not a file\n"
            "hint: save the samples to a file with numpy.save(path, array) and pass its path"
        )
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
        loaded: np.ndarray = np.load(path, allow_pickle=False, mmap_mode="r")  # read from disk batch by batch
    except (ValueError, OSError, EOFError) as exc:
        if "Python objects" in str(exc):  # an array of objects is pickled (never unpickled here), and cannot be mapped
            raise ConfigError(
                f"--input {str(path)!r} holds Python objects (rows of different lengths, dicts), not numbers\n"
                "hint: save the samples as one numeric array of equal-sized rows, e.g. numpy.save(path, np.stack(rows))"
            ) from exc
        raise ConfigError(
            f"--input {str(path)!r} cannot be read as a .npy array: {exc}\n"
            "hint: the file may be truncated: write it again with numpy.save(path, array)"
        ) from exc
    if loaded.ndim == 0:  # one value: a sample of a model taking scalars, saved without the batch dimension
        raise ConfigError(
            f"--input {str(path)!r} holds one value (shape ()), not samples along a first dimension\n"
            "hint: the first dimension counts the samples: save this one as numpy.save(path, array[None])"
        )
    if len(loaded) == 0:
        raise ConfigError(
            f"--input {str(path)!r} holds no samples (shape {loaded.shape})\n"
            "hint: save at least one sample along the first dimension: numpy.save(path, array)"
        )
    return loaded  # saved on a big-endian machine, it stays so on the map: each batch is read into native order


def check_samples(samples: np.ndarray, servable: Servable, path: Path) -> None:
    """Refuse samples whose shape is not (N, *input_shape), or whose dtype does not convert to the input's."""
    expected = servable.input_shape
    if tuple(samples.shape[1:]) != expected:
        raise ConfigError(f"--input {str(path)!r}: {_misfit(tuple(samples.shape), expected, servable.name)}")
    # The server's own checks (dtype kind, integer range, finite floats within the dtype), a chunk at a time.
    spec = InputSpec(expected, servable.input_dtype, max_batch_size=CHECK_CHUNK)
    for start in range(0, len(samples), CHECK_CHUNK):
        try:
            check_array(samples[start : start + CHECK_CHUNK], spec)
        except Refused as refused:
            problem = refused.message.split("; expected ")[0].split(FIRST_IN_SAMPLE)[0]
            first = refused.fields.get("first_bad_sample")  # none when the dtype itself does not fit
            where = "every sample" if first is None else f"row {start + first} (the first that fails)"
            raise ConfigError(
                f"--input {str(path)!r}: {where}: {problem}\n"
                f"hint: save the array as {servable.input_dtype} values the model can take"
            ) from None


def _misfit(shape: tuple[int, ...], expected: tuple[int, ...], name: str) -> str:
    """Why an array of ``shape`` is not samples of ``expected``'s shape, and the fix: a batch dimension, or a reshape
    where each row holds one sample's values in another shape (``(N, 64)`` or ``(N, 8, 8)`` for ``(1, 8, 8)``)."""
    dims, batch = ", ".join(map(str, expected)), shape_text(("N", *expected))
    if shape == expected:  # one sample, saved without the batch dimension
        return (
            f"the array {shape} is one sample of {name}'s input shape, without the batch dimension; "
            f"expected {batch}\n"
            "hint: save it as a batch of one: numpy.save(path, array[None])"
        )
    said = f"samples of shape {shape[1:]} (array {shape}) do not fit {name}; expected {batch}"
    if len(shape) == 1:  # a flat array: one value a sample, or samples flattened together
        said = f"the array {shape} is flat (one value a sample) and does not fit {name}; expected {batch}"
    reshape = f"numpy.save(path, array.reshape(-1, {dims}))"
    if math.prod(shape[1:]) != math.prod(expected):
        hint = "the first dimension counts the samples; each sample has the model's input shape"
        if math.prod(shape) % math.prod(expected) == 0 and math.prod(shape[1:]) < math.prod(expected):
            count = math.prod(shape) // math.prod(expected)  # the samples flattened together: (64,) for (1, 8, 8)
            hint += f"; the array holds the values of {count:,} such samples: {reshape}, if they are in order"
        return f"{said}\nhint: {hint}"
    if tuple(d for d in shape[1:] if d != 1) == tuple(d for d in expected if d != 1):  # only axes of size 1 differ
        return f"{said}\nhint: each row holds one sample's values; add or drop its axes of size 1: {reshape}"
    return (
        f"{said}\nhint: each row holds as many values as one sample: {reshape}, if they are in the model's order "
        "(axes in another order, as channels last, need array.transpose first)"
    )


def run_batches(
    engine: InferenceEngine, samples: np.ndarray, batch_size: int, source: str, hint: str,
    emit: Callable[[np.ndarray], None],
) -> float:  # fmt: skip
    """Run ``samples`` batch by batch with a progress bar on stderr, each batch's outputs to ``emit``; return the
    seconds taken.

    The model raising on a batch is an InferenceError naming its rows of ``source`` (the input), with ``hint``.
    """
    kind: tuple[tuple[int, ...], np.dtype] | None = (
        None  # one sample's output shape and dtype: every batch's the first's
    )
    bar = transient_bar(  # a file that takes hours says how long is left, not only how long it ran
        TextColumn("predict"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"),
        TimeRemainingColumn(), console=Console(stderr=True),
    )  # fmt: skip
    started = time.perf_counter()
    with bar:
        job = bar.add_task("predict", total=len(samples))
        for start in range(0, len(samples), batch_size):
            # off the read-only map (torch warns of one), in native byte order (torch reads no other)
            batch = np.array(samples[start : start + batch_size], dtype=samples.dtype.newbyteorder("="))
            rows = f"rows {start} to {start + len(batch) - 1}"
            try:
                outputs = engine.predict(batch).numpy()
            except (Exception, SystemExit) as exc:  # a model's sys.exit() would end the command saying nothing
                row = first_failing_row(engine, batch, exc)
                of = f"of {source} ({len(samples)} rows)"
                running, check = f"predicting {rows} {of}", hint
                if row is not None:  # as the server does, the batch's rows were run alone to find the one
                    running = f"predicting row {start + row} {of}, which fails alone ({rows} ran together)"
                    check = hint.replace(ROWS_CHECK, f"check row {start + row}'s values", 1)
                with model_raising(running, check):
                    raise
            kind = (outputs.shape[1:], outputs.dtype) if kind is None else kind
            if outputs.shape[1:] != kind[0]:
                raise InferenceError(
                    f"the model's outputs changed shape while predicting {rows} of {source}: "
                    f"{outputs.shape[1:]} per sample, where the rows before gave {kind[0]}; the "
                    "outputs are written as one array\nhint: give every sample's output one shape, whatever the batch: "
                    "not one that follows the batch's size (each batch is padded to one of the plan's buckets) "
                    "or its values"
                )
            if outputs.dtype != kind[1]:  # written as the first batch's dtype, floats would be cut to integers
                raise InferenceError(
                    f"the model's outputs changed dtype while predicting {rows} of {source}: {outputs.dtype}, where "
                    f"the rows before gave {kind[1]}; the outputs are written as one array\nhint: give every "
                    "batch's outputs one dtype, whatever its values (cast them in forward: .float())"
                )
            emit(outputs)
            bar.advance(job, len(batch))
    return time.perf_counter() - started


def first_failing_row(engine: InferenceEngine, batch: np.ndarray, exc: Exception | SystemExit) -> int | None:
    """The first row of ``batch`` the model raises on when run alone, after the batch raised ``exc``.

    None for a lone row, for an out-of-memory error (the rows alone would fit) or an error of
    redline's own or of the device (no row is to blame), and when no row fails alone.
    """
    if len(batch) < 2 or is_oom(exc) or isinstance(exc, RedlineError) or not blames_user_code(exc) or engine.broken:
        return None
    for row in range(len(batch)):
        try:
            engine.predict(batch[row : row + 1])
        except (Exception, SystemExit):
            return row
    return None


def check_hint(servable: Servable, samples: np.ndarray | None = None, *, precision: str = "auto") -> str:
    """What to check when the model raises: in the warm-up (no ``samples``), or on rows of ``samples``; under a
    precision that casts the weights, first that the model runs in that dtype throughout."""
    takes = f"the model takes the Servable's input_shape {servable.input_shape} and input_dtype {servable.input_dtype}"
    if samples is None:
        check = f"check that {takes}: the warm-up runs zeros of that shape and dtype, as --input's rows will be"
    else:
        held = f"--input holds {samples.dtype} samples of shape {samples.shape[1:]}"
        check = f"{ROWS_CHECK}, and that {takes} ({held})"
    if precision not in WEIGHT_DTYPES:
        return check
    dtype = str(WEIGHT_DTYPES[precision]).removeprefix("torch.")
    mixed = MIXED_OF[precision]
    return (
        f"--precision {precision} runs the model in {dtype} throughout (weights and floating inputs): a tensor it "
        f"makes in float32 meets {dtype} ones, which dtype=x.dtype avoids, or pass --precision {mixed} (autocast); "
        f"else {check}"
    )


@wrapping_errors
def model_raising(running: str, check: str) -> Iterator[None]:
    """Turn the model's exception into an InferenceError naming what was ``running``, the user's line and the fix.

    The fix is ``check``, or lowering --batch-size for an out-of-memory error. What the model gave and
    the engine cannot use (a ServableError) is told with what was ``running``; any other redline error
    passes unchanged, and so does an exception redline's own code raised (a bug of redline's, not
    the model's: ``blames_user_code``). The model's exception, whole traceback and all, is the
    error's ``__cause__`` (REDLINE_TRACEBACK=1 prints it).
    """
    try:
        yield
    except SystemExit as exc:  # the model's sys.exit(): the command would end with its code, saying nothing
        raise InferenceError(
            f"the model raised SystemExit({exc.code!r}) while {running}: a model raises an exception, it does not end "
            f"the program{user_line(exc)}\nhint: raise an exception in the model instead; REDLINE_TRACEBACK=1 prints "
            "the whole traceback"
        ) from exc
    except ServableError as exc:
        raise InferenceError(f"while {running}: {exc}") from exc
    except RedlineError:
        raise
    except Exception as exc:
        if not blames_user_code(exc):
            raise
        line = user_line(exc)
        if is_oom(exc):
            hint = "lower --batch-size: the device ran out of memory on batches of up to that many samples"
        else:
            hint = check + ("; if so, the line above is where your code failed" if line else "")
        raise InferenceError(
            f"the model raised while {running}: {describe_error(exc)}{line}\n"
            f"hint: {hint}; REDLINE_TRACEBACK=1 prints the whole traceback"
        ) from exc


def write_outputs(path: Path, rows: int, run: Callable[[Callable[[np.ndarray], None]], float]) -> float:
    """Write the ``rows`` outputs that ``run(emit)`` emits batch by batch to ``path`` as one .npy array; return what
    ``run`` returns.

    Each batch goes to disk as it comes, so outputs as large as the input need no more memory than it
    does; through a temporary file, so a failure or a crash leaves the old file or none. A device or a
    named pipe (``--output /dev/null``) is written into directly.
    """
    returned: list[float] = []

    def write(target: Path) -> None:  # a temporary file, or the device or pipe itself (write_atomic)
        with target.open("wb") as out:
            returned.append(run(NpyWriter(out, rows)))

    try:
        write_atomic(path, write)
    except OSError as exc:  # a disk that filled up while the model ran
        raise _unwritable(path, exc) from exc
    return returned[0]


class NpyWriter:
    """Write one .npy array of ``rows`` rows a batch at a time, its header told by the first batch's shape and dtype.

    Only ``write`` is called on the file: numpy's own ``tofile`` asks a pipe its position.
    """

    def __init__(self, out: BinaryIO, rows: int) -> None:
        self.out = out
        self.rows = rows
        self.dtype: np.dtype | None = None

    def __call__(self, batch: np.ndarray) -> None:
        if self.dtype is None:
            self.dtype = batch.dtype
            header = {"descr": np.lib.format.dtype_to_descr(batch.dtype), "fortran_order": False,
                      "shape": (self.rows, *batch.shape[1:])}  # fmt: skip
            try:
                np.lib.format.write_array_header_1_0(self.out, header)  # what numpy.save writes, where it fits
            except ValueError:  # a header over 64 KiB (a shape of many dimensions)
                np.lib.format.write_array_header_2_0(self.out, header)
        self.out.write(np.ascontiguousarray(batch, dtype=self.dtype).data)


NOT_WRITTEN = "--output was not written (a file there is kept)"


def _is_npy(path: Path) -> bool:
    """Whether ``path`` holds a .npy array (an earlier run's outputs, say): it starts with numpy's magic bytes."""
    return read_head(path).startswith(NPY_MAGIC)


def _unwritable(path: Path, exc: OSError) -> ConfigError:
    if isinstance(exc, BrokenPipeError):  # --output /dev/stdout | head: the reader went first
        return ConfigError(
            f"--output {str(path)!r} cannot be written: the program reading it exited before every row was written\n"
            "hint: let the reader take the whole array (numpy.load reads it from a pipe), or write a file"
        )
    return ConfigError(
        f"--output {str(path)!r} cannot be written ({exc.strerror or exc})\n"
        "hint: write the outputs to a directory you can write to, on a disk with room for them"
    )
