"""`redline serve`: a model behind HTTP with dynamic batching; prints the engine's Plan and the URL.

The server's flags come from ServeOptions (serve/options.py); the engine's (device, precision,
compile, CUDA graphs) and the model's (SPEC, --weights, --task-arg) are this command's own.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated, Any

import typer

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
    build,
    command,
    flags,
    said_by_flags,
)
from redline.cli.signals import stopped_by_signal
from redline.cli.task_args import load_given_servable
from redline.errors import invalid
from redline.render.console import output_console, plan_table, print_uncut
from redline.serve.batcher import bucket_sizes
from redline.serve.engine import InferenceEngine
from redline.serve.options import ServeOptions, check_engine_options
from redline.serve.servable import as_model_spec
from redline.serve.server import bind, serve

log = logging.getLogger("redline")


def _serve(
    spec: ModelSpec,
    weights: Weights = None,
    task_arg: TaskArgs = None,
    device: EngineDevice = "auto",
    precision: EnginePrecision = "auto",
    compile: EngineCompile = "auto",
    cuda_graphs: EngineGraphs = "auto",
    measure: EngineMeasure = "auto",
    channels_last: EngineLayout = "auto",
    batch_buckets: Annotated[
        str,
        typer.Option(
            metavar="auto|SIZES",
            help="Batch sizes a batch is padded up to, each warmed up (compiled, captured): auto (powers of two up "
            "to --max-batch-size) or sizes such as 1,8,32, the largest equal to --max-batch-size.",
        ),
    ] = "auto",
    **parsed: Any,
) -> None:
    """Serve a model over HTTP with dynamic batching, bounded queueing and Prometheus metrics."""
    options = build(ServeOptions, parsed)
    with said_by_flags(**ENGINE_FLAGS):  # a bad engine flag is told before the model loads, by its flag
        check_engine_options(
            device=device, precision=precision, compile=compile, cuda_graphs=cuda_graphs, measure=measure,
            channels_last=channels_last,
        )  # fmt: skip
    with said_by_flags(batch_buckets="--batch-buckets", max_batch_size="--max-batch-size"):
        buckets = _buckets(batch_buckets)  # auto stays "auto": the Plan then says the buckets are the default
        bucket_sizes(options.batch_limit, buckets)  # checked before the model loads
    options.token()  # an empty --token-env variable is refused before the model loads
    sock = bind(options.host, options.port)  # and so are a busy port and a host not of this machine
    try:
        # Loading, measuring and compiling can take minutes: a signal then says so, where by default it would end
        # the process without a word. From listening on, the server drains on a signal instead.
        with stopped_by_signal("loading the model", "nothing was served"):
            with as_model_spec(spec):  # not a task spec, as the loader would say
                servable = load_given_servable(spec, task_arg, weights)
            with said_by_flags(**ENGINE_FLAGS):
                engine = InferenceEngine(
                    servable, device=device, precision=precision, compile=compile, cuda_graphs=cuda_graphs,
                    measure=measure, channels_last=channels_last, max_batch_size=options.batch_limit,
                    batch_buckets=buckets,
                )  # fmt: skip
        console = output_console()
        print_uncut(console, plan_table(engine.plan, title=f"Serving {servable.name}"))

        def listening(url: str) -> None:
            _say(f"listening on {url} (POST {url}/v1/predict; ready at {url}/readyz once warmed up)")

        serve(engine, options, sock=sock, on_listen=listening, on_ready=lambda: _say("ready: warm-up done"))
    finally:
        sock.close()
    _say("stopped: every accepted request was answered")


def _buckets(text: str) -> str | tuple[int, ...]:
    """``auto``, or the sizes ``1,8,32`` names; anything else is a ConfigError naming the argument."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return tuple(int(size) for size in text.split(","))
    except ValueError:
        raise invalid(
            "batch_buckets", text, "auto, or batch sizes separated by commas", "e.g. --batch-buckets 1,8,32"
        ) from None


def _say(line: str) -> None:
    """Print ``line`` on stdout, flushed: a supervisor reading the pipe sees the URL at once.

    Once stdout's reader is gone (it exited: ``| grep -m1 listening``; or stdout was closed), the line is
    dropped, and so is every later one: they were for that reader alone, and the server serves on.
    """
    try:
        print(line, flush=True)
    except (OSError, ValueError):  # BrokenPipeError from a pipe whose reader exited; ValueError from a closed file
        _stdout_to_devnull()
        log.info("redline serve: stdout's reader is gone; the server serves on, printing nothing more there")


def _stdout_to_devnull() -> None:
    """Send what stdout still buffers, and all it is given from now on, to os.devnull.

    Else Python's flush of stdout at exit fails again, prints "Exception ignored ... BrokenPipeError" and
    exits 120, after a server that stopped cleanly. The file descriptor is redirected, as Python's docs
    advise for SIGPIPE: https://docs.python.org/3/library/signal.html#note-on-sigpipe
    """
    try:
        descriptor = sys.stdout.fileno()
    except (OSError, ValueError):  # closed, or a stream of no file (a test's capture): replaced instead
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (open while the process lives, as stdout)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


serve_command = command(_serve, flags(ServeOptions))
