"""`redline loadtest`: drive a URL open loop (--rate) or closed loop (--concurrency) and print what it measured."""

from __future__ import annotations

import json
from contextlib import ExitStack
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from redline.cli.options import build, command, flags, said_by_flags
from redline.errors import RedlineError
from redline.render.console import output_console, print_uncut, result_out, transient_bar
from redline.render.loadtest import loadtest_tables
from redline.serve.loadtest import LoadOptions, Payload, check_url, load_test
from redline.serve.loadtest import Progress as LoadProgress


def _loadtest(
    url: Annotated[str, typer.Argument(metavar="URL", help="The URL to load, e.g. http://127.0.0.1:8000/v1/predict.")],
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
    **parsed: Any,
) -> None:
    """Load a URL at a fixed rate (open loop) or concurrency, and report latency percentiles and statuses.

    Open loop (--rate) times each request from its scheduled send time, so a stalling server shows
    in the tail; closed loop (--concurrency) finds peak throughput but hides queueing. Progress goes
    to stderr. Exits 2 when no measured request got a 2xx answer, after printing the report.
    """
    options = build(LoadOptions, parsed)
    check_url(url)
    with said_by_flags(payload="--payload"):
        payload = Payload.from_file(options.payload) if options.payload is not None else None
    with ExitStack() as stack:
        shown: list[tuple[Progress, TaskID]] = []

        def tell(now: LoadProgress) -> None:
            if not shown:  # started on the first report, after the URL was found reachable
                bar = transient_bar(
                    TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), refresh_per_second=4,
                )  # fmt: skip
                stack.enter_context(bar)
                shown.append((bar, bar.add_task("", total=now.total_s)))
            bar, job = shown[0]
            described = f"sent {now.sent}  done {now.completed}  errors {now.errors}  in flight {now.in_flight}"
            bar.update(job, completed=min(now.elapsed_s, now.total_s), description=described)

        result = load_test(url, options, payload=payload, progress=tell)
    if json_output:
        print(json.dumps(result.to_dict(), indent=2), file=result_out())
    else:
        out = output_console()
        for table in loadtest_tables(result):
            print_uncut(out, table)
        for note in result.notes:
            out.print(f"note: {note}", highlight=False, markup=False)
    if result.requests_sent and not any(200 <= status < 300 for status in result.status_counts):
        # printed first, but a load test that measured errors alone has failed (bench's and tune's exit 2 alike)
        raise RedlineError(
            f"no request of the {result.requests_sent} measured got a 2xx answer: the service was not measured, "
            "its refusals or the client's errors were; the report's note says what they got"
        )


loadtest_command = command(_loadtest, flags(LoadOptions))
