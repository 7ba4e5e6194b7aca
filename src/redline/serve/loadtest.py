"""`redline loadtest`: an asyncio HTTP client that measures a server's latency honestly.

Open loop (``rate``): request i is due at t0 + offset_i and goes out then, whether or not earlier
ones have returned; its latency counts from that due time, so a server that stalls shows in the
tail instead of silently slowing the client (coordinated omission, Gil Tene, "How NOT to Measure
Latency", https://www.infoq.com/presentations/latency-response-time/). Closed loop
(``concurrency``): C workers, each sending when its last request returned; it finds the peak
throughput, but its latency hides the queueing. The pure half (schedule, percentiles, the
result) is in load_stats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from yarl import URL

from redline.config import non_negative_int, non_negative_number, one_of, option, positive_int, positive_number
from redline.errors import ConfigError, StoppedBySignal, invalid, nearest, refuse_inside_event_loop
from redline.serve.load_payload import Payload, is_token, parse_headers
from redline.serve.load_signals import give_back_signals, on_stop_signals
from redline.serve.load_stats import (
    Arrivals,
    LoadResult,
    Mode,
    RequestRecord,
    Setup,
    keep_said,
    schedule,
    summarize,
)

DEFAULT_RATE = 10.0  # requests/s when neither a rate nor a concurrency is given: a gentle open-loop probe
LEAD_S = 0.05  # the schedule starts this long after setup, so that request 0 is not late by construction
PROGRESS_EVERY_S = 0.25
STOP_CHECK_S = 0.1  # the longest the schedule sleeps between looks at a Ctrl-C
# Requests one run may schedule: every one is kept (its send time, then its record), and one client process sends
# a few thousand a second; a rate with a few zeros too many would fill the memory before the first request.
MAX_REQUESTS = 10_000_000
MAX_CONCURRENCY = 100_000  # closed-loop workers, each a connection: beyond what one client process can hold
# What each open-loop setting does, said when one is given beside a concurrency, where it would be ignored.
OPEN_LOOP_ONLY = {
    "arrivals": "the workers send back to back, on no schedule",
    "seed": "it seeds the poisson arrivals of open loop",
    "max_in_flight": "the concurrency is the most requests in flight",
    "max_send_lag_ms": "the workers follow no schedule to lag behind",
}


class LoadStopped(StoppedBySignal):
    """Ctrl-C or SIGTERM stopped the load test before its measured window began: nothing to report (exit 130, 143)."""


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How hard, how long and with what a load test drives a URL."""

    rate: float | None = option(None, "Open loop: requests per second, each sent at its scheduled time.")
    concurrency: int | None = option(None, "Closed loop: workers each sending when their last request returned.", min=1)
    duration_s: float = option(10.0, "Seconds of the measured window.", flag="--duration")
    warmup_s: float = option(0.0, "Seconds of load before the window, left out of the results.", flag="--warmup")
    timeout_s: float = option(10.0, "Seconds a request may take before it counts as a timeout.", flag="--timeout")
    payload: Path | None = option(None, "A .json file (sent as application/json) or .npy (octet-stream).")
    method: str | None = option(None, "HTTP method (default: POST with a payload, GET without).")
    headers: tuple[str, ...] = option((), "A header K:V, e.g. 'Authorization: Bearer T'; repeatable.", flag="--header")
    arrivals: Arrivals = option("uniform", "Open loop: uniform gaps of 1/rate, or poisson (seeded).")
    seed: int = option(0, "Seed of the poisson arrivals.")
    max_in_flight: int = option(512, "Open loop: the most requests outstanding; more wait in the client.", min=1)
    max_send_lag_ms: float = option(10.0, "Open loop: p99 lag behind the schedule above which the client says so.")

    def __post_init__(self) -> None:
        if isinstance(self.payload, str):  # a path as a string, as run_load takes it
            object.__setattr__(self, "payload", Path(self.payload))
        if self.payload is not None and not isinstance(self.payload, Path):
            raise invalid("payload", self.payload, "a .json or .npy file's path", "e.g. payload='body.json'")
        if self.rate is not None and self.concurrency is not None:  # said by their flags on the command line
            raise invalid(
                "concurrency", self.concurrency, f"no concurrency beside rate={self.rate:g}: one of the two",
                "keep rate=R for latency (open loop), or concurrency=C for peak throughput (closed loop)",
            )  # fmt: skip
        positive_number("rate", self.rate, optional=True)
        positive_int("concurrency", self.concurrency, optional=True)
        self._check_open_loop_only()
        positive_number("duration", self.duration_s)
        non_negative_number("warmup", self.warmup_s, "a finite number of seconds >= 0")
        positive_number("timeout", self.timeout_s)
        one_of("arrivals", self.arrivals, ("uniform", "poisson"))
        non_negative_int("seed", self.seed)
        positive_int("max_in_flight", self.max_in_flight)
        total_s, rate = self.total_s, self.open_rate
        if not math.isfinite(total_s):  # each finite, their sum not
            raise invalid("duration", self.duration_s, f"with --warmup {self.warmup_s:g}, a finite number of seconds")
        if rate is not None and rate * total_s > MAX_REQUESTS:
            named, value = ("rate", rate) if self.rate is not None else ("duration", self.duration_s)
            at = "" if self.rate is not None else f" at the default {DEFAULT_RATE:g} requests/s"
            raise invalid(
                named, value,
                f"at most {MAX_REQUESTS:,} requests in all; it schedules {rate * total_s:,.0f} in {total_s:g} s{at}",
                "one client process sends a few thousand requests/s: lower the rate, shorten the warmup and the "
                "duration, or run several clients",
            )  # fmt: skip
        if self.concurrency is not None and self.concurrency > MAX_CONCURRENCY:
            raise invalid(
                "concurrency", self.concurrency, f"at most {MAX_CONCURRENCY:,} workers, each with a connection",
                "one client process keeps a few thousand connections busy: lower it, or run several clients",
            )  # fmt: skip
        positive_number("max_send_lag_ms", self.max_send_lag_ms)
        if self.method is not None and not is_token(self.method):
            raise invalid("method", self.method, "an HTTP method such as GET or POST", "e.g. method='POST'")
        object.__setattr__(self, "headers", tuple(self.headers))
        parse_headers(self.headers)

    def _check_open_loop_only(self) -> None:
        """Refuse, beside a concurrency, a setting that shapes open loop alone: taken without a word, it would be
        ignored, and the run would not be the one asked for (poisson arrivals, say)."""
        if self.concurrency is None:
            return
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, why in OPEN_LOOP_ONLY.items():
            if getattr(self, name) != defaults[name]:
                raise invalid(
                    name, getattr(self, name), f"nothing beside concurrency={self.concurrency}: {why}",
                    "drop it for closed loop (peak throughput), or give rate=R instead of a concurrency for open "
                    "loop (latency)",
                )  # fmt: skip

    @property
    def total_s(self) -> float:
        """The run's length: the warm-up and the measured window."""
        return self.warmup_s + self.duration_s

    @property
    def open_rate(self) -> float | None:
        """The open loop's requests/s: the rate given, the default where neither it nor a concurrency is; None for
        a closed loop."""
        return self.rate if self.rate is not None or self.concurrency is not None else DEFAULT_RATE

    @property
    def mode(self) -> Mode:
        """'closed' when a concurrency was given, else 'open'."""
        return "closed" if self.concurrency is not None else "open"


@dataclass(frozen=True)
class Progress:
    """A live view of a run, given to the progress callback a few times a second."""

    elapsed_s: float
    total_s: float  # warm-up plus window; the wait for the last responses comes after
    sent: int
    completed: int
    errors: int
    in_flight: int


ProgressCallback = Callable[[Progress], None]


@dataclass
class _Counters:
    sent: int = 0
    completed: int = 0
    errors: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    stopped_s: float | None = None  # when a Ctrl-C (or SIGTERM) came, from t0: nothing is sent after it
    stopped_by: signal.Signals | None = signal.SIGINT  # which of the two it was; None: MAX_REQUESTS were sent
    said: dict[str, str] = field(default_factory=dict)  # the first answer of each status but 2xx, or error, in short


@dataclass(frozen=True)
class _Request:
    url: str
    method: str
    body: bytes | None
    headers: dict[str, str]
    deadline_s: float = math.inf  # from t0: a request still queued then is not sent (the window and --timeout over)


def _timeouts() -> tuple[type[BaseException], ...]:
    """The timeout errors: the builtin, and asyncio's own, a class apart before Python 3.11 (3.10 is supported)."""
    return (TimeoutError, asyncio.TimeoutError)


def error_kind(exc: BaseException) -> str:
    """Name a client-side failure: timeout, connection_refused, connection_reset, connection_error or other."""
    if isinstance(exc, _timeouts()):  # aiohttp's socket and connect timeouts subclass asyncio's
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connection_refused" if isinstance(exc.os_error, ConnectionRefusedError) else "connection_error"
    if isinstance(exc, aiohttp.ServerDisconnectedError | ConnectionResetError | BrokenPipeError):
        return "connection_reset"
    if isinstance(exc, aiohttp.ClientOSError):
        return "connection_reset" if isinstance(exc.__cause__, ConnectionResetError) else "connection_error"
    return "other"


async def _send(
    session: aiohttp.ClientSession, request: _Request, slots: asyncio.Semaphore, t0: float, scheduled: float,
    counters: _Counters,
) -> None:  # fmt: skip
    """Send one request when a slot is free and record its timeline, relative to ``t0``."""
    dispatched = time.perf_counter() - t0
    counters.sent += 1
    waited = slots.locked()
    async with slots:
        sent = time.perf_counter() - t0
        if waited and counters.stopped_s is not None:  # queued behind --max-in-flight when a Ctrl-C came: not sent
            counters.sent -= 1
            return
        if waited and sent > request.deadline_s:  # queued past the window and --timeout: late beyond it, not sent
            counters.errors += 1
            keep_said(counters.said, "timeout", "waited in the client past the window's end and --timeout, not sent")
            counters.records.append(RequestRecord(scheduled, dispatched, sent, sent, None, "timeout", waited))
            return
        status = error = None
        try:
            # A redirect is not followed: the latency would time two requests, and a 301 or 302 turns a POST
            # into a GET; it is counted as its status, and a note says where it points.
            async with session.request(request.method, request.url, data=request.body, headers=request.headers,
                                       allow_redirects=False) as response:  # fmt: skip
                body = await response.read()
                status = response.status
                if not 200 <= status < 300:
                    location = response.headers.get("Location") if status < 400 else None
                    keep_said(counters.said, str(status), location or body.decode("utf-8", errors="replace"))
        except (aiohttp.ClientError, OSError, TimeoutError, asyncio.TimeoutError, ValueError) as exc:
            error = error_kind(exc)  # a ValueError: the client refused what it was to send ("other"), not the run
            keep_said(counters.said, error, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        done = time.perf_counter() - t0
    counters.completed += status is not None
    counters.errors += error is not None
    counters.records.append(RequestRecord(scheduled, dispatched, sent, done, status, error, waited))


async def _open_loop(
    session: aiohttp.ClientSession, request: _Request, offsets: Sequence[float], cap: int, t0: float,
    counters: _Counters,
) -> None:  # fmt: skip
    """Start each request at its scheduled time, however many are outstanding."""
    slots = asyncio.Semaphore(cap)
    tasks = []
    for offset in offsets:
        await sleep_until(t0 + offset, counters)
        if counters.stopped_s is not None:
            break
        tasks.append(asyncio.create_task(_send(session, request, slots, t0, offset, counters)))
    await asyncio.gather(*tasks)


async def sleep_until(deadline: float, counters: _Counters) -> None:
    """Return once ``time.perf_counter()`` reaches ``deadline`` (or a Ctrl-C came), having yielded at least once.

    uvloop's timers count whole milliseconds and wake up to 1 ms early: a request sent then would be
    timed from its due time as up to 1 ms faster than it was.
    """
    # sleep(0) when behind: it still yields, so the requests already started get sent
    await asyncio.sleep(min(max(deadline - time.perf_counter(), 0.0), STOP_CHECK_S))
    while (left := deadline - time.perf_counter()) > 0 and counters.stopped_s is None:
        await asyncio.sleep(min(left, STOP_CHECK_S))


async def _closed_loop(
    session: aiohttp.ClientSession, request: _Request, workers: int, end_s: float, t0: float, counters: _Counters
) -> None:
    """Run ``workers`` loops that each send the next request when the last returned, until ``end_s``."""
    slots = asyncio.Semaphore(workers)

    async def worker() -> None:
        await asyncio.sleep(max(t0 - time.perf_counter(), 0.0))
        while (now := time.perf_counter() - t0) < end_s and counters.stopped_s is None:
            if counters.sent >= MAX_REQUESTS:  # a long soak run: stopped, as by a Ctrl-C, before memory runs out
                counters.stopped_s, counters.stopped_by = now, None
                break
            await _send(session, request, slots, t0, now, counters)

    await asyncio.gather(*(worker() for _ in range(workers)))


async def _report(progress: ProgressCallback, counters: _Counters, t0: float, total_s: float) -> None:
    while True:
        progress(Progress(time.perf_counter() - t0, total_s, counters.sent, counters.completed, counters.errors,
                          counters.sent - counters.completed - counters.errors))  # fmt: skip
        await asyncio.sleep(PROGRESS_EVERY_S)


CONNECT_S = 5.0  # the least the reachability check waits to connect: a short --timeout is the requests' alone


async def check_reachable(url: str, timeout_s: float) -> None:
    """Open (and close) a TCP connection to the URL's host and port, waiting up to ``timeout_s`` (``CONNECT_S`` at
    least); raise ConfigError if that fails."""
    parsed = URL(url)
    deadline_s = max(timeout_s, CONNECT_S)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parsed.host, parsed.port), deadline_s)
    except (OSError, TimeoutError, asyncio.TimeoutError) as exc:
        timed_out = isinstance(exc, _timeouts())
        reason = f"no answer in {deadline_s:g} s" if timed_out else (exc.strerror or str(exc))
        hint = "start the server first (redline serve ...), or check the host and port"
        if timed_out:  # not refused: something drops the connection, or the host is down
            hint = "check the host and port: a host that is down, or a firewall that drops the connection, is silent"
        raise ConfigError(
            f"cannot reach {url}: connecting to {parsed.host}:{parsed.port} failed ({reason})\nhint: {hint}"
        ) from exc
    writer.close()


def check_url(url: str) -> str:
    """Return ``url`` if it is an absolute http(s) URL with a host; raise ConfigError if not."""
    try:
        parsed = URL(url)
    except (ValueError, TypeError) as exc:  # the parser's reason ("Port out of range 0-65535") says what is wrong
        expected = f"an http:// or https:// URL ({exc})" if str(exc) else "an http:// or https:// URL"
        raise invalid("url", url, expected, "e.g. http://127.0.0.1:8000/v1/predict") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise invalid("url", url, "an http:// or https:// URL", "e.g. http://127.0.0.1:8000/v1/predict")
    return url


async def run_load_async(
    url: str,
    options: LoadOptions,
    *,
    payload: Payload | None = None,
    progress: ProgressCallback | None = None,
    stop_on_sigint: bool = False,
) -> LoadResult:
    """Drive ``url`` as ``options`` say and return what was measured; ``payload`` overrides ``options.payload``.

    ``stop_on_sigint``: a first Ctrl-C or SIGTERM (a scheduler's, timeout(1)'s) ends the window there (the
    requests out are waited for, and the result covers the window up to it); a second Ctrl-C raises
    KeyboardInterrupt, a second SIGTERM ends the process. Before the window, it raises LoadStopped.
    """
    check_url(url)
    if payload is None and options.payload is not None:
        payload = Payload.from_file(options.payload)
    method = (options.method or ("POST" if payload else "GET")).upper()
    headers = parse_headers(options.headers)
    if payload is not None and not any(name.lower() == "content-type" for name in headers):
        headers["Content-Type"] = payload.content_type  # unless --header gave one, in any case: it would go twice
    total_s, rate = options.total_s, options.open_rate
    request = _Request(url, method, payload.body if payload else None, headers, total_s + options.timeout_s)
    await check_reachable(url, options.timeout_s)
    cap = options.concurrency or options.max_in_flight
    setup = Setup(
        mode=options.mode, url=url, method=method, target_rate=rate,
        concurrency=options.concurrency, arrivals=options.arrivals, duration_s=options.duration_s,
        warmup_s=options.warmup_s, timeout_s=options.timeout_s, max_in_flight=cap,
        max_send_lag_ms=options.max_send_lag_ms,
    )  # fmt: skip
    notes = []
    if rate == DEFAULT_RATE and options.rate is None:
        notes.append(f"neither a rate nor a concurrency given: open loop at {DEFAULT_RATE:g} requests/s")
    counters = _Counters()
    connector = aiohttp.TCPConnector(limit=cap, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # aiohttp sends an idempotent request (GET, HEAD, PUT, DELETE, OPTIONS) again, unseen, when the server reset or
        # closed its connection: the reset would go uncounted, and both round trips timed as one request. Its own test
        # client turns that off the same way (aiohttp.test_utils, from 3.11, which the serve extra requires); an
        # aiohttp that renamed the private attribute is not refused for it (tests/cpu/test_loadtest.py would fail).
        if hasattr(session, "_retry_connection"):
            session._retry_connection = False
        t0 = time.perf_counter() + LEAD_S
        reporter = asyncio.create_task(_report(progress, counters, t0, total_s)) if progress else None
        stoppable = on_stop_signals(lambda signum: _stop(counters, signum, t0)) if stop_on_sigint else {}
        try:
            if rate is not None:
                offsets = schedule(rate, total_s, arrivals=options.arrivals, seed=options.seed)
                await _open_loop(session, request, offsets, cap, t0, counters)
            else:
                await _closed_loop(session, request, cap, total_s, t0, counters)
        finally:
            if reporter is not None:
                reporter.cancel()
            if stoppable:
                give_back_signals(stoppable)
    elapsed_s = time.perf_counter() - t0
    if progress:
        progress(Progress(elapsed_s, total_s, counters.sent, counters.completed, counters.errors, 0))
    # A Ctrl-C after the window (while the last answers were awaited) cut nothing: the window stays whole.
    if counters.stopped_s is not None and counters.stopped_s < total_s:
        window_s = counters.stopped_s - options.warmup_s
        stopper, kept = counters.stopped_by, f"after {MAX_REQUESTS:,} requests, the most one run keeps,"
        by = kept if stopper is None else "by Ctrl-C" if stopper == signal.SIGINT else f"by {stopper.name}"
        if window_s <= 0:
            said = f"stopped {by} {max(counters.stopped_s, 0.0):.1f} s into the warm-up: nothing was measured"
            raise ConfigError(f"{said}\nhint: shorten --warmup") if stopper is None else LoadStopped(stopper, said)
        setup = dataclasses.replace(setup, duration_s=window_s)
        notes.append(
            f"stopped {by} {window_s:.1f} s into the {options.duration_s:g} s window: the figures cover those "
            f"{window_s:.1f} s" + ("\nhint: a shorter --duration, or runs one after another" if stopper is None else "")
        )
    return summarize(counters.records, setup, elapsed_s=elapsed_s, notes=notes, said=counters.said)


def run_load(
    url: str,
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    duration: float = 10.0,
    warmup: float = 0.0,
    timeout: float = 10.0,
    payload: str | Path | Payload | None = None,
    method: str | None = None,
    headers: Mapping[str, str] | Sequence[str] = (),
    progress: ProgressCallback | None = None,
    **more: object,
) -> LoadResult:
    """Load-test ``url`` and return the LoadResult: open loop at ``rate`` or closed loop with ``concurrency``.

    Blocks (it runs its own event loop); inside a running loop, await run_load_async. ``more``
    takes LoadOptions' other fields (arrivals, seed, max_in_flight, max_send_lag_ms). ``headers``
    is a mapping or ``K:V`` strings; ``payload`` a .json or .npy file, or a Payload.
    """
    _check_more(more)
    if isinstance(headers, Mapping):
        headers = [f"{name}: {value}" for name, value in headers.items()]
    if payload is not None and not isinstance(payload, Payload | str | Path):  # it sent GETs with no body
        raise invalid("payload", payload, "a .json or .npy file's path, or a Payload", "e.g. payload='body.json'")
    body = payload if isinstance(payload, Payload) else None
    path = Path(payload) if isinstance(payload, str | Path) else None
    options = LoadOptions(
        rate=rate, concurrency=concurrency, duration_s=duration, warmup_s=warmup, timeout_s=timeout,
        payload=path, method=method, headers=tuple(headers),
        **more,  # type: ignore[arg-type]
    )  # fmt: skip
    return load_test(url, options, payload=body, progress=progress)


# run_load's own keywords, by the LoadOptions field each sets; ``more`` takes the other fields
_NAMED = {"rate": "rate", "concurrency": "concurrency", "duration_s": "duration", "warmup_s": "warmup",
          "timeout_s": "timeout", "payload": "payload", "method": "method", "headers": "headers"}  # fmt: skip


def _check_more(more: Mapping[str, object]) -> None:
    """Refuse a keyword of run_load's that is no LoadOptions field, or one it names itself (``duration_s``: run_load
    takes ``duration``), with the keyword meant."""
    others = [f.name for f in dataclasses.fields(LoadOptions) if f.name not in _NAMED]
    for name, value in more.items():
        if name in others:
            continue
        meant = _NAMED.get(name) or nearest(name, [*_NAMED.values(), *others])
        raise invalid(
            name, value, "a keyword of run_load: " + ", ".join([*_NAMED.values(), *others, "progress"]),
            f"did you mean {meant}={value!r}?" if meant else "see help(redline.serve.loadtest.run_load)",
        )  # fmt: skip


def load_test(
    url: str, options: LoadOptions, *, payload: Payload | None = None, progress: ProgressCallback | None = None
) -> LoadResult:
    """Run run_load_async on an event loop of its own (uvloop's where installed) and return its result.

    A first Ctrl-C (in the main thread) ends the run early with what it measured so far; a second quits.

    The loop is made and closed here, as asyncio.Runner would (Python 3.11+; 3.10 is supported too).
    """
    refuse_inside_event_loop(
        "run_load blocks on an event loop of its own",
        "await run_load_async(url, LoadOptions(rate=..., duration_s=...)) there",
    )
    loop = (_loop_factory() or asyncio.new_event_loop)()
    try:
        running = run_load_async(url, options, payload=payload, progress=progress, stop_on_sigint=True)
        return loop.run_until_complete(running)
    finally:
        left = asyncio.all_tasks(loop)  # stopped early (Ctrl-C): the requests still out are cancelled
        for task in left:
            task.cancel()
        if left:  # gather() of nothing would make its future on another loop
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _stop(counters: _Counters, signum: signal.Signals, t0: float) -> None:
    if counters.stopped_s is None:  # a run the request limit stopped already ended there, not later
        counters.stopped_s, counters.stopped_by = time.perf_counter() - t0, signum


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where installed (the serve extra brings it): less client overhead per request."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
