"""The pure half of `redline loadtest`: the send schedule, percentiles, and the result computed from a timeline.

Nothing here touches the network or the clock, so the coordinated-omission rule (an open-loop
request's latency counts from its scheduled send time) is tested on synthetic timelines.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from redline.errors import invalid

Mode = Literal["open", "closed"]
Arrivals = Literal["uniform", "poisson"]

MAX_SAID = 8  # statuses (or client errors) whose first answer is kept, for the notes
SAID_CHARS = 200  # of an answer's body quoted in a note
PERCENTILE_METHOD = "linear interpolation between the closest ranks of the sorted samples (numpy's default)"


def keep_said(said: dict[str, str], outcome: str, text: str) -> None:
    """Keep ``text``, in one line cut to SAID_CHARS, as what ``outcome`` (a status, or a client error's kind) first
    said, for MAX_SAID outcomes: summarize quotes it in the notes."""
    if outcome not in said and len(said) < MAX_SAID:
        text = " ".join(text.split())
        said[outcome] = text if len(text) <= SAID_CHARS else text[: SAID_CHARS - 3] + "..."


def schedule(rate: float, duration_s: float, *, arrivals: Arrivals = "uniform", seed: int = 0) -> list[float]:
    """Return the send offsets in seconds from the start, every one below ``duration_s``.

    Uniform: request i at i / rate. Poisson: exponential gaps of mean 1 / rate from a generator
    seeded with ``seed``, so a run's arrivals can be repeated.
    """
    if not (math.isfinite(rate) and rate > 0):
        raise invalid("rate", rate, "a number of requests per second > 0", "e.g. rate=100")
    if not (math.isfinite(duration_s) and duration_s >= 0):
        raise invalid("duration_s", duration_s, "a number of seconds >= 0", "e.g. duration_s=10")
    if arrivals == "uniform":
        count = math.ceil(rate * duration_s - 1e-9)  # i / rate < duration_s, without float noise at the edge
        return [i / rate for i in range(max(count, 0))]
    if arrivals != "poisson":
        raise invalid(
            "arrivals", arrivals, "'uniform' or 'poisson'",
            "poisson sends at random gaps, as independent users do; uniform at even ones",
        )  # fmt: skip
    draw = random.Random(seed)
    offsets, t = [], draw.expovariate(rate)
    while t < duration_s:
        offsets.append(t)
        t += draw.expovariate(rate)
    return offsets


def percentile(ordered: Sequence[float], q: float) -> float:
    """Return the ``q``-th percentile (0..100) of samples sorted ascending, by linear interpolation.

    The rank is q / 100 * (n - 1) and the value between its two neighbours is interpolated: the
    "linear" method of numpy.percentile (Hyndman and Fan's type 7). Exact, from every sample.
    """
    if not ordered:
        raise invalid("samples", [], "at least one sample")
    if not 0 <= q <= 100:
        raise invalid("q", q, "a percentile from 0 to 100")
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, kw_only=True)
class LatencyStats:
    """Summary of a set of durations, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float


def latency_stats(seconds: Sequence[float]) -> LatencyStats | None:
    """Summarise durations given in seconds; None when there are none."""
    if not seconds:
        return None
    ordered = sorted(seconds)
    ms = [s * 1000 for s in ordered]
    return LatencyStats(
        count=len(ms),
        mean_ms=math.fsum(ms) / len(ms),
        p50_ms=percentile(ms, 50),
        p90_ms=percentile(ms, 90),
        p99_ms=percentile(ms, 99),
        p999_ms=percentile(ms, 99.9),
        max_ms=ms[-1],
    )


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's timeline, in seconds from the start of the run, and how it ended.

    ``scheduled``: when it was due; ``dispatched``: when the client got round to it (their gap is
    the client's own lag); ``sent``: when it had a connection slot; ``done``: its end. Exactly one
    of ``status`` (the HTTP status) and ``error`` (a client error kind) is set.
    """

    scheduled: float
    dispatched: float
    sent: float
    done: float
    status: int | None = None
    error: str | None = None
    waited_for_slot: bool = False


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What a run was asked to do: the part of a LoadResult that does not depend on the server."""

    mode: Mode
    url: str
    method: str
    target_rate: float | None  # open loop
    concurrency: int | None  # closed loop
    arrivals: Arrivals
    duration_s: float
    warmup_s: float
    timeout_s: float
    max_in_flight: int
    max_send_lag_ms: float


# The fields a mode gives no meaning to, left out of its JSON: a closed loop has no rate, arrivals or schedule to
# lag behind, and its cap on requests in flight is its concurrency, which no request waits for.
OTHER_MODE_FIELDS: dict[Mode, frozenset[str]] = {
    "open": frozenset({"concurrency"}),
    "closed": frozenset(
        {"target_rate", "arrivals", "send_lag_ms", "client_kept_up", "max_in_flight", "waited_for_slot"}
    ),
}


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """What a load test measured; latencies over the requests whose origin fell in the measured window.

    The origin is the scheduled send time in open loop and the actual send time in closed loop.
    ``achieved_rps`` counts the responses that arrived inside the window, over its length. In closed
    loop the open-loop fields (OTHER_MODE_FIELDS) hold their defaults, and ``to_dict`` leaves them out.
    """

    mode: Mode
    url: str
    method: str
    target_rate: float | None
    concurrency: int | None
    arrivals: Arrivals
    duration_s: float
    warmup_s: float
    timeout_s: float
    requests_sent: int  # whose origin fell in the measured window
    requests_completed: int  # got an HTTP status, any
    requests_failed: int  # got a client error instead: timeout, refused, reset
    achieved_rps: float
    success_rps: float  # 2xx only
    latency_ms: LatencyStats | None  # every completed request
    latency_2xx_ms: LatencyStats | None
    status_counts: dict[int, int]
    error_counts: dict[str, int]
    send_lag_ms: LatencyStats | None  # open loop: dispatch time minus scheduled time
    client_kept_up: bool
    max_in_flight: int
    waited_for_slot: int  # requests that queued in the client because max_in_flight were outstanding
    elapsed_s: float  # wall time of the whole run: warm-up, window and the wait for the last responses
    percentile_method: str = PERCENTILE_METHOD
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Return the result as JSON-ready data (status codes as string keys), the fields of its mode alone.

        Closed loop leaves out open loop's rate, arrivals, send lag and in-flight cap (its workers follow
        no schedule and its cap is the concurrency); open loop leaves out the concurrency.
        """
        data = {name: value for name, value in asdict(self).items() if name not in OTHER_MODE_FIELDS[self.mode]}
        data["status_counts"] = {str(code): n for code, n in sorted(self.status_counts.items())}
        data["error_counts"] = dict(sorted(self.error_counts.items()))
        data["notes"] = list(self.notes)
        return data


CLOSED_LOOP_NOTE = (
    "closed loop: each worker sends its next request only when its last one returned, so a slow server "
    "slows the client with it and the requests it would have received meanwhile are never sent or timed "
    "(coordinated omission); the latency here is a service time; use --rate (open loop) to measure the "
    "latency a stream of users would see"
)


def _timed_out_note(answered_s: list[float], given_up_s: list[float], measured: int, timeout_s: float) -> str:
    """Say how many requests timed out, and the p99 with them counted when given up: a floor on the true one, given
    only where it is above the p99 shown (of the answered requests); else that they leave the tail unmeasured."""
    said = (
        f"{len(given_up_s)} of {measured} requests timed out (--timeout {timeout_s:g} s) and are not in the latency "
        "figures"
    )
    hint = "\nhint: raise --timeout above the slowest answer to time them all"
    shown = percentile([s * 1000 for s in sorted(answered_s)], 99)  # as latency_stats computes the table's
    floor = percentile([s * 1000 for s in sorted(answered_s + given_up_s)], 99)
    if round(floor, 2) > round(shown, 2):  # as the table and the note print them
        return f"{said}, which understate the tail: counted when given up, the p99 is at least {floor:.2f} ms{hint}"
    # Given up below the slowest answers (a deadline that came sooner), they do not raise the p99: no floor to give.
    return (
        f"{said}: given up sooner than the slowest answers came, they leave the tail unmeasured, and the p99 of every "
        f"request may be above the one shown ({shown:.2f} ms){hint}"
    )


def summarize(
    records: Sequence[RequestRecord],
    setup: Setup,
    *,
    elapsed_s: float,
    notes: Sequence[str] = (),
    said: Mapping[str, str] | None = None,
) -> LoadResult:
    """Compute a LoadResult from every request's timeline; the warm-up and anything after the window are left out.

    ``said``: by status ("404") or client error ("timeout"), what the first such answer said in short (a
    redirect's Location, else its body; the error's message), quoted in the notes.
    """
    said = said or {}
    start, end = setup.warmup_s, setup.warmup_s + setup.duration_s
    open_loop = setup.mode == "open"

    def origin(r: RequestRecord) -> float:
        return r.scheduled if open_loop else r.sent

    measured = [r for r in records if start <= origin(r) < end]
    completed = [r for r in measured if r.status is not None]
    ok = [r for r in completed if 200 <= r.status < 300]  # type: ignore[operator]
    in_window = [r for r in records if r.status is not None and start <= r.done < end]
    length = setup.duration_s or math.inf
    lag = latency_stats([r.dispatched - r.scheduled for r in measured]) if open_loop else None
    kept_up = lag is None or lag.p99_ms <= setup.max_send_lag_ms
    waited = sum(r.waited_for_slot for r in measured)
    out = list(notes)
    if not kept_up:
        out.append(
            f"the client fell behind its schedule: p99 send lag {lag.p99_ms:.1f} ms > {setup.max_send_lag_ms:g} ms "  # type: ignore[union-attr]
            "(--max-send-lag-ms); it drove less than the target rate, and the latencies include its own delay\n"
            "hint: lower --rate, or run the client on another machine or in more processes"
        )
    if open_loop and waited:
        out.append(
            f"{waited} requests waited in the client because {setup.max_in_flight} were already outstanding "
            "(--max-in-flight); their latency still counts from their scheduled send time"
        )
    if not open_loop:
        out.append(CLOSED_LOOP_NOTE)
    redirects = Counter(r.status for r in completed if r.status is not None and 300 <= r.status < 400)
    if redirects:
        status = redirects.most_common(1)[0][0]
        where = said.get(str(status), "an unknown place")
        out.append(
            f"{sum(redirects.values())} answers were redirects ({status} to {where}): "
            "not followed, as the latency would time two requests (and a 301 or 302 turns a POST into a GET)\n"
            "hint: load the URL they point to"
        )
    if not measured:  # a low rate over a short window (poisson may draw no arrival): empty tables, said why
        pace = f"at {setup.target_rate:g} requests/s the schedule put none there" if open_loop else "none was sent"
        out.append(
            f"no request fell in the {setup.duration_s:g} s window ({pace}): there is nothing to measure\n"
            f"hint: raise {'--rate or ' if open_loop else ''}--duration"
        )
    timed_out = [r for r in measured if r.error == "timeout"]
    if timed_out and completed:  # left out of the latencies, they would hide the very tail a stall makes
        answered_s = [r.done - origin(r) for r in completed]
        out.append(_timed_out_note(answered_s, [r.done - origin(r) for r in timed_out], len(measured), setup.timeout_s))
    if measured and not ok:  # a wrong payload or URL: the figures above time refusals, not the service
        outcomes = Counter(str(r.status) if r.status is not None else (r.error or "unknown") for r in measured)
        top, count = outcomes.most_common(1)[0]
        hint = "check the URL, --method, --payload and --header with one request (curl -i), then load it"
        if top == "timeout":  # no answer to quote: the timeout may be shorter than the service takes
            who = "every one" if count == len(measured) else f"{count} of them"
            quoted = f"; {who} outlasted --timeout ({setup.timeout_s:g} s)"
            hint = "if the service is this slow, raise --timeout; else lower the load, or check the URL"
        else:
            first = next((what for what, _ in outcomes.most_common() if what in said), None)
            quoted = f"; the first {first} said: {said[first]}" if first is not None else ""
        out.append(
            f"no request got a 2xx answer ({', '.join(f'{n} x {what}' for what, n in outcomes.most_common())}): "
            f"the latencies are those of errors, not of the service{quoted}\nhint: {hint}"
        )
    return LoadResult(
        mode=setup.mode,
        url=setup.url,
        method=setup.method,
        target_rate=setup.target_rate,
        concurrency=setup.concurrency,
        arrivals=setup.arrivals,
        duration_s=setup.duration_s,
        warmup_s=setup.warmup_s,
        timeout_s=setup.timeout_s,
        requests_sent=len(measured),
        requests_completed=len(completed),
        requests_failed=len(measured) - len(completed),
        achieved_rps=len(in_window) / length,
        success_rps=sum(200 <= r.status < 300 for r in in_window) / length,  # type: ignore[operator]
        latency_ms=latency_stats([r.done - origin(r) for r in completed]),
        latency_2xx_ms=latency_stats([r.done - origin(r) for r in ok]),
        status_counts=dict(Counter(r.status for r in completed)),  # type: ignore[misc]
        error_counts=dict(Counter(r.error or "unknown" for r in measured if r.status is None)),
        send_lag_ms=lag,
        client_kept_up=kept_up,
        max_in_flight=setup.max_in_flight,
        waited_for_slot=waited,
        elapsed_s=elapsed_s,
        notes=tuple(out),
    )
