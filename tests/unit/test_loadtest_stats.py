"""The pure half of `redline loadtest`: schedule, percentiles, and a result computed from synthetic timelines."""

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from redline.errors import ConfigError
from redline.serve.load_stats import (
    CLOSED_LOOP_NOTE,
    RequestRecord,
    Setup,
    latency_stats,
    percentile,
    schedule,
    summarize,
)


def setup(
    mode="open", *, duration_s=10.0, warmup_s=0.0, rate=100.0, max_send_lag_ms=10.0, max_in_flight=512, timeout_s=5.0
):
    return Setup(
        mode=mode, url="http://127.0.0.1:1/x", method="GET", target_rate=rate if mode == "open" else None,
        concurrency=None if mode == "open" else 1, arrivals="uniform", duration_s=duration_s, warmup_s=warmup_s,
        timeout_s=timeout_s, max_in_flight=max_in_flight, max_send_lag_ms=max_send_lag_ms,
    )  # fmt: skip


def record(scheduled, done, status=200, *, sent=None, dispatched=None, error=None, waited=False):
    sent = scheduled if sent is None else sent
    dispatched = scheduled if dispatched is None else dispatched
    return RequestRecord(scheduled, dispatched, sent, done, None if error else status, error, waited)


# --- percentiles -----------------------------------------------------------------------------------------------


def test_percentile_interpolates_linearly_between_ranks():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert percentile([7.0], 99.9) == 7.0
    ordered = [float(i) for i in range(1, 1001)]  # 1..1000: p99.9 is 0.999 of the way from 1 to 1000
    assert percentile(ordered, 99.9) == pytest.approx(1 + 0.999 * 999)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_matches_numpys_default(samples, q):
    assert percentile(sorted(samples), q) == pytest.approx(np.percentile(samples, q), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize(("samples", "q", "message"), [([], 50, "at least one sample"), ([1.0], 101, "0 to 100")])
def test_percentile_refuses_what_it_cannot_compute(samples, q, message):
    with pytest.raises(ConfigError, match=message):
        percentile(samples, q)


def test_latency_stats_are_in_milliseconds_and_none_without_samples():
    stats = latency_stats([0.003, 0.001, 0.002, 0.010])
    assert stats is not None
    assert (stats.count, stats.p50_ms, stats.max_ms) == (4, pytest.approx(2.5), pytest.approx(10.0))
    assert stats.mean_ms == pytest.approx(4.0)
    assert latency_stats([]) is None


# --- schedule --------------------------------------------------------------------------------------------------


def test_uniform_schedule_sends_at_i_over_rate():
    assert schedule(10, 1.0) == pytest.approx([i / 10 for i in range(10)])
    assert schedule(0.5, 3.0) == [0.0, 2.0]
    assert len(schedule(100, 0.3)) == 30  # 100 * 0.3 is 30.000000000000004 in floats: no 31st request
    assert len(schedule(3, 1.0)) == 3 and max(schedule(3, 1.0)) < 1.0


def test_poisson_schedule_is_seeded_and_has_the_asked_mean_rate():
    first = schedule(200, 10.0, arrivals="poisson", seed=1)
    assert first == schedule(200, 10.0, arrivals="poisson", seed=1)
    assert first != schedule(200, 10.0, arrivals="poisson", seed=2)
    assert all(b > a for a, b in itertools.pairwise(first)) and first[0] > 0 and first[-1] < 10.0
    assert abs(len(first) - 2000) < 5 * math.sqrt(2000)  # a Poisson count: mean 2000, sd about 45
    gaps = np.diff(first)
    assert np.std(gaps) == pytest.approx(np.mean(gaps), rel=0.1)  # exponential gaps: sd equals mean; uniform's is 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rate": 0, "duration_s": 1.0}, "rate=0"), ({"rate": float("inf"), "duration_s": 1.0}, "rate=inf"),
     ({"rate": 1, "duration_s": -1.0}, "duration_s=-1.0"),
     ({"rate": 1, "duration_s": 1.0, "arrivals": "bursty"}, "arrivals='bursty'")],
)  # fmt: skip
def test_schedule_refuses_bad_input(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        schedule(**kwargs)


# --- coordinated omission ---------------------------------------------------------------------------------------

SERVICE_S = 0.001
STALL = (5.0, 6.0)  # the server answers nothing for one second


def serve(arrival: float, free_at: float) -> float:
    """Return when a FIFO server with one worker, free from ``free_at``, finishes a request arriving at ``arrival``."""
    start = max(arrival, free_at)
    if STALL[0] <= start < STALL[1]:
        start = STALL[1]
    return start + SERVICE_S


def open_loop_timeline() -> list[RequestRecord]:
    free_at, records = 0.0, []
    for due in schedule(100, 10.0):
        free_at = serve(due, free_at)
        records.append(record(due, free_at))
    return records


def closed_loop_timeline() -> list[RequestRecord]:
    now, records = 0.0, []
    while now < 10.0:  # one worker: the next request leaves when the last returned
        done = serve(now, now)
        records.append(record(now, done))
        now = done
    return records


def test_a_one_second_stall_shows_in_the_open_loop_p99_and_hides_from_the_closed_loop():
    open_result = summarize(open_loop_timeline(), setup("open"), elapsed_s=10.0)
    closed_result = summarize(closed_loop_timeline(), setup("closed"), elapsed_s=10.0)
    assert open_result.latency_ms is not None and closed_result.latency_ms is not None
    # Open loop: the 100 requests due during the stall waited up to 1 s each; 10% of the samples.
    assert open_result.requests_sent == 1000
    assert open_result.latency_ms.p99_ms > 800
    assert open_result.latency_ms.p90_ms > 5
    # Closed loop: the client stopped sending, so one sample of ~9000 saw the stall.
    assert closed_result.requests_sent > 8000
    assert closed_result.latency_ms.p99_ms == pytest.approx(SERVICE_S * 1000)
    assert open_result.latency_ms.max_ms == pytest.approx(1000 + SERVICE_S * 1000, abs=1)
    assert closed_result.latency_ms.max_ms == pytest.approx(1000 + SERVICE_S * 1000, abs=1)
    assert CLOSED_LOOP_NOTE in closed_result.notes and CLOSED_LOOP_NOTE not in open_result.notes


def test_open_loop_latency_counts_the_wait_for_a_connection_slot():
    # Due at 1.0, it got a slot at 1.5 (max_in_flight were outstanding) and returned at 1.6.
    result = summarize([record(1.0, 1.6, sent=1.5, waited=True)], setup("open"), elapsed_s=2.0)
    assert result.latency_ms is not None and result.latency_ms.max_ms == pytest.approx(600)
    assert result.waited_for_slot == 1
    assert any("1 requests waited in the client because 512 were already outstanding" in n for n in result.notes)
    closed = summarize([record(1.0, 1.6, sent=1.5)], setup("closed"), elapsed_s=2.0)
    assert closed.latency_ms is not None and closed.latency_ms.max_ms == pytest.approx(100)


# --- the result ------------------------------------------------------------------------------------------------


def test_summary_counts_the_window_only_and_splits_statuses_and_errors():
    records = [
        record(0.5, 0.6),  # warm-up: left out entirely
        record(1.0, 1.2),
        record(1.5, 1.6, status=503),
        record(2.0, 2.5, status=500),
        record(2.5, 2.6, error="timeout"),
        record(2.8, 3.4, error="connection_reset"),
        record(2.9, 3.5),  # in the window, answered after it: in the latency, not in the throughput
        record(3.0, 3.1),  # due after the window
    ]
    result = summarize(records, setup("open", warmup_s=1.0, duration_s=2.0), elapsed_s=3.5)
    assert (result.requests_sent, result.requests_completed, result.requests_failed) == (6, 4, 2)
    assert result.status_counts == {200: 2, 503: 1, 500: 1}
    assert result.error_counts == {"timeout": 1, "connection_reset": 1}
    assert result.achieved_rps == pytest.approx(3 / 2.0)  # 1.2, 1.6 and 2.5 arrived inside [1, 3)
    assert result.success_rps == pytest.approx(1 / 2.0)
    assert result.latency_ms is not None and result.latency_2xx_ms is not None
    assert result.latency_ms.count == 4 and result.latency_ms.max_ms == pytest.approx(600)
    assert result.latency_2xx_ms.count == 2 and result.latency_2xx_ms.p50_ms == pytest.approx(400)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["status_counts"] == {"200": 2, "500": 1, "503": 1}
    assert data["latency_ms"]["p999_ms"] == pytest.approx(result.latency_ms.p999_ms)
    assert data["mode"] == "open" and data["target_rate"] == 100.0
    assert [n.split(" and are not")[0] for n in data["notes"]] == ["1 of 6 requests timed out (--timeout 5 s)"]


COMMON_FIELDS = {
    "mode", "url", "method", "duration_s", "warmup_s", "timeout_s", "requests_sent", "requests_completed",
    "requests_failed", "achieved_rps", "success_rps", "latency_ms", "latency_2xx_ms", "status_counts", "error_counts",
    "elapsed_s", "percentile_method", "notes",
}  # fmt: skip
OPEN_FIELDS = {"target_rate", "arrivals", "send_lag_ms", "client_kept_up", "max_in_flight", "waited_for_slot"}


def test_the_json_of_each_mode_holds_the_fields_that_mean_something_for_it():
    # Closed loop has no rate, arrivals or schedule: a "uniform" arrivals, a null rate, a client that "kept up"
    # with no schedule and a cap no request waited for would be read as facts about the run.
    closed = summarize([record(i / 10, i / 10 + 0.05) for i in range(10)], setup("closed", duration_s=1.0),
                       elapsed_s=1.1).to_dict()  # fmt: skip
    assert set(closed) == COMMON_FIELDS | {"concurrency"} and closed["concurrency"] == 1
    opened = summarize([record(i / 10, i / 10 + 0.05) for i in range(10)], setup("open", duration_s=1.0),
                       elapsed_s=1.1).to_dict()  # fmt: skip
    assert set(opened) == COMMON_FIELDS | OPEN_FIELDS and opened["target_rate"] == 100.0
    assert json.loads(json.dumps(closed)) == closed and json.loads(json.dumps(opened)) == opened


def test_requests_that_timed_out_in_a_stall_are_said_to_be_missing_from_the_tail():
    # The server answers in 1 ms but stalls for a second; the requests due then are given up at --timeout (5 s).
    records = [
        record(due, due + 5.0, error="timeout") if STALL[0] <= due < STALL[1] else record(due, due + SERVICE_S)
        for due in schedule(100, 10.0)
    ]
    result = summarize(records, setup("open"), elapsed_s=15.0)
    assert result.latency_ms is not None and result.latency_ms.p99_ms == pytest.approx(SERVICE_S * 1000)
    assert result.error_counts == {"timeout": 100}
    assert (
        "100 of 1000 requests timed out (--timeout 5 s) and are not in the latency figures, which understate the "
        "tail: counted when given up, the p99 is at least 5000.00 ms\nhint: raise --timeout above the slowest answer"
    ) in "\n".join(result.notes)
    quick = summarize([record(i / 100, i / 100 + 0.001) for i in range(100)], setup(), elapsed_s=10.0)
    assert not any("timed out" in n for n in quick.notes)


@pytest.mark.parametrize(
    "answered_in", [lambda i: 2 + i / 100, lambda i: 2 + i % 10 / 10], ids=["each its own time", "ten of each"]
)
def test_requests_given_up_below_the_slowest_answers_give_no_floor_under_the_p99_shown(answered_in):
    # 90 answered in 2 to 2.9 s; 10 given up at --timeout (1 s), below them: counted, they lower the p99 (2880.10
    # where the table shows 2881.10 ms) or leave it as shown, so "at least" that figure would say nothing.
    records = [record(i / 10, i / 10 + answered_in(i)) for i in range(90)]
    records += [record(9 + k / 10, 10 + k / 10, error="timeout") for k in range(10)]
    result = summarize(records, setup(timeout_s=1.0), elapsed_s=11.0)
    assert result.latency_ms is not None
    shown = f"{result.latency_ms.p99_ms:.2f}"
    note = next(n for n in result.notes if "timed out" in n)
    assert "at least" not in note
    assert note == (
        "10 of 100 requests timed out (--timeout 1 s) and are not in the latency figures: given up sooner than the "
        f"slowest answers came, they leave the tail unmeasured, and the p99 of every request may be above the one "
        f"shown ({shown} ms)\nhint: raise --timeout above the slowest answer to time them all"
    )


def test_a_client_behind_its_schedule_says_so():
    late = [record(i / 100, i / 100 + 0.03, dispatched=i / 100 + 0.02) for i in range(100)]
    result = summarize(late, setup("open", duration_s=1.0), elapsed_s=1.1)
    assert result.send_lag_ms is not None and result.send_lag_ms.p99_ms == pytest.approx(20)
    assert result.client_kept_up is False
    assert any(n.startswith("the client fell behind its schedule: p99 send lag 20.0 ms > 10 ms") for n in result.notes)
    on_time = summarize([record(i / 100, i / 100 + 0.01) for i in range(100)], setup("open", duration_s=1.0),
                        elapsed_s=1.1)  # fmt: skip
    assert on_time.client_kept_up is True and on_time.notes == ()


def test_a_run_without_a_single_2xx_says_its_latencies_are_of_errors():
    records = [record(i / 100, i / 100 + 0.002, 422) for i in range(30)]
    records += [record(0.5 + i / 100, 0.5, error="connection_refused") for i in range(10)]
    result = summarize(records, setup(), elapsed_s=10.0)
    assert result.latency_ms is not None and result.latency_2xx_ms is None
    told = "no request got a 2xx answer (30 x 422, 10 x connection_refused): the latencies are those of errors"
    assert any(n.startswith(told) for n in result.notes), result.notes
    fine = summarize([record(0.0, 0.002, 200), record(0.01, 0.012, 422)], setup(), elapsed_s=10.0)
    assert not any("2xx" in n for n in fine.notes)


def test_a_window_without_a_single_request_says_so_and_how_to_get_some():
    result = summarize([record(0.5, 0.6)], setup(rate=0.1, duration_s=1.0, warmup_s=1.0), elapsed_s=2.0)
    assert result.requests_sent == 0 and result.latency_ms is None
    assert result.notes == (
        "no request fell in the 1 s window (at 0.1 requests/s the schedule put none there): there is nothing to "
        "measure\nhint: raise --rate or --duration",
    )
