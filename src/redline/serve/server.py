"""Run the app under uvicorn: bind, warm up, serve, and on SIGTERM drain before exiting.

uvicorn[standard] brings uvloop and httptools; ``loop="auto"`` and ``http="auto"`` take them when
present. The socket is bound before uvicorn starts, so ``port=0`` gets a free port that is known
(and printed) at once; ``redline serve`` binds it before it even loads the model, so that a busy
port or a wrong host is told at once, not after minutes of loading, measuring and compiling.
On SIGTERM or SIGINT /readyz turns 503, uvicorn stops accepting connections, the requests
already in (queued ones included) are answered, and then the worker stops: every accepted
request ends by its deadline (504), so the grace period is the request timeout plus a margin.
The process then exits with 0, as a server asked to stop does.

Once warmed up, the heap is frozen (``gc.freeze``): the hundreds of thousands of objects torch,
the model and the server made at start-up leave the collector's view, so its full collections no
longer pause the event loop for tens of milliseconds. That halved the p99 at concurrency 64 for
the digits CNN on a 2-core machine (108-116 ms to 47-51 ms, two runs each, requests/s unchanged).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import math
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from redline.errors import RedlineError, StoppedBySignal, refuse_inside_event_loop, user_line
from redline.runtime.contract import blames_user_code
from redline.runtime.oom import is_oom
from redline.serve.app import build_app
from redline.serve.options import ServeOptions

GRACE_MARGIN_S = 5.0  # beyond the request timeout, for the answers to be written and the worker to stop


class ServerFailed(RedlineError):
    """The server could not serve: its model failed to warm up."""

    exit_code = 1


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app that shutdown began, and exiting cleanly after a graceful stop."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None], on_force: Callable[[], int]) -> None:
        super().__init__(config)
        self._on_stop = on_stop
        self._on_force = on_force
        self.abandoned = 0  # requests answered 503 unrun, when a second Ctrl-C stopped the server at once
        # a signal the process was started ignoring stays ignored, as Python leaves it: a script's background
        # server (`redline serve ... &`) ignores SIGINT, so that a Ctrl-C to the script's job in front spares it
        self._ignored = {sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is signal.SIG_IGN}

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig in self._ignored:
            return
        # uvicorn's own handler would raise the signal again after the graceful stop, ending the process
        # as killed (-15); a server that drained as asked exits with 0.
        self._on_stop()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:
            # uvicorn stops waiting for the requests and skips the app's shutdown: its lifespan and the handlers
            # still waiting would end cancelled, each client getting a bare 500 and the log a traceback. Each is
            # answered 503 instead, and the app shut down without waiting for the model.
            self.abandoned = self._on_force()
            deadline = time.monotonic() + FORCED_ANSWERS_S
            while self.server_state.tasks and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            shut_down = getattr(self.lifespan, "shutdown_event", None)  # set: forced while it shut down already
            if shut_down is None or not shut_down.is_set():
                await self.lifespan.shutdown()


FORCED_ANSWERS_S = 1.0  # after a second Ctrl-C, the longest the 503 answers are given to go out
BACKLOG = 2048  # connections the kernel holds for uvicorn to accept


def _http(timeout_s: float) -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol with each request's head bounded (serve/guard.py), or "auto" where httptools is
    not installed: uvicorn then runs h11, which bounds a head's size itself (16 KiB), though not its time."""
    try:
        from redline.serve.guard import guarded_http
    except ImportError:
        return "auto"
    return guarded_http(timeout_s)


def bind(host: str, port: int) -> socket.socket:
    """Return a TCP socket bound to ``host:port`` (port 0: a free one), not listening yet.

    The port is held from now on, by this socket alone; connections are refused until ``listen``.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port a stopped server left in TIME_WAIT binds
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            hint = "pick another --port (0 takes any free one), or stop the process holding it"
        elif exc.errno == errno.EACCES:
            hint = "ports below 1024 need privileges: pick --port 1024 or above (0 takes any free one)"
        else:  # EADDRNOTAVAIL, or a name that does not resolve: the host is not this machine's
            hint = "--host takes an address of this machine: 127.0.0.1 (itself alone) or 0.0.0.0 (every interface)"
        raise RedlineError(f"cannot listen on {host}:{port}: {exc.strerror or exc}\nhint: {hint}") from None
    # Linux lets two sockets bind one port when both set SO_REUSEADDR and neither listens yet: without this,
    # a second `redline serve` on the port would bind it while this one loads its model, and take it.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    sock.set_inheritable(True)
    return sock


def listen(sock: socket.socket) -> None:
    """Start accepting connections on a socket from ``bind``, which held its port alone until now."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own sockets have it
    sock.listen(BACKLOG)


def freeze_heap() -> int:
    """Collect, then move every object alive into the collector's permanent generation; return how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def url_of(sock: socket.socket) -> str:
    """The http URL a bound socket answers on."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    engine: Any,
    options: ServeOptions | None = None,
    *,
    sock: socket.socket | None = None,
    on_listen: Callable[[str], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Serve ``engine`` until SIGTERM or SIGINT; ``on_listen(url)`` once listening, ``on_ready()`` after warm-up.

    ``sock``: a socket from ``bind`` (else one is bound to ``options``' host and port); it is closed
    at the end. What ``on_ready`` raises is logged as a warning, and the server serves on. Raise ServerFailed
    (exit code 1) when the model's warm-up failed. A model call whose requests all timed out may still run on
    return: ``dispatch.calls_left_running()`` says so to a process about to exit.
    """
    options = (options or ServeOptions()).for_engine(engine)  # the engine's max_batch_size where left out
    refuse_inside_event_loop(
        "serve() blocks on uvicorn's own event loop",
        "await uvicorn.Server(uvicorn.Config(redline.build_app(engine, options), port=8000)).serve() there, "
        "or run `redline serve SPEC` in a terminal",
    )
    app = build_app(engine, options)
    serving = app.state.serving
    sock = sock if sock is not None else bind(options.host, options.port)
    listen(sock)
    config = uvicorn.Config(
        app, loop="auto", http=_http(options.timeout_ms / 1000), lifespan="on", access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=math.ceil(options.timeout_ms / 1000 + GRACE_MARGIN_S),
    )  # fmt: skip
    server = _Server(config, serving.begin_drain, serving.abandon)

    def failed(reason: str) -> None:
        server.should_exit = True

    def ready() -> None:
        freeze_heap()
        if on_ready is not None:
            on_ready()

    serving.dispatcher.on_ready = ready
    serving.dispatcher.on_failed = failed
    if on_listen is not None:
        on_listen(url_of(sock))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if serving.dispatcher.failed is not None:
        raise ServerFailed(stopped_by(serving.dispatcher.failed, serving.dispatcher.error, engine, options)) from (
            serving.dispatcher.error
        )
    if server.abandoned:
        raise StoppedBySignal(
            signal.SIGINT,
            f"stopped at once by a second Ctrl-C: {server.abandoned} request{'s' * (server.abandoned != 1)} queued or "
            "in the model were answered 503 without their outputs\nhint: stop the server with one Ctrl-C or SIGTERM "
            "to answer every accepted request first",
        )


def stopped_by(reason: str, exc: Exception | None, engine: Any, options: ServeOptions) -> str:
    """Why the server stopped (its warm-up failed): the user's line and the fix, or that redline's own code failed."""
    message = f"the server stopped: {reason}"
    if exc is None or isinstance(exc, RedlineError):  # a redline error names its own fix, on its hint line
        hints = [line for line in str(exc).splitlines() if line.startswith("hint:")] if exc is not None else []
        return "\n".join([message, *hints[:1]])
    if not blames_user_code(exc):
        hint = "redline's own code failed, not the model: please report it with the traceback"
    elif is_oom(exc):
        hint = f"lower --max-batch-size: the warm-up runs batches of up to {options.batch_limit} samples"
    else:
        servable = engine.servable
        hint = (
            f"check that the model takes the Servable's input_shape {servable.input_shape} and input_dtype "
            f"{servable.input_dtype}: the warm-up runs zeros of that shape and dtype, in batches of up to "
            f"{options.batch_limit}"
            + ("; if it does, the line above is where your code failed" if user_line(exc) else "")
        )
    return f"{message}{user_line(exc)}\nhint: {hint}; REDLINE_TRACEBACK=1 prints the whole traceback"
