"""Whether a compiled row's compile was served from torch's on-disk caches: read from torch's counters (faked here),
and carried to the rows that share its graph."""

from __future__ import annotations

import collections

import pytest

from redline.bench.compile_cache import cache_lookups, served_from_cache
from redline.bench.result import BenchRow
from redline.bench.rows import _with_shared_compiles


@pytest.fixture
def counters(monkeypatch) -> collections.defaultdict[str, collections.Counter[str]]:
    """torch's counters, as torch._dynamo.utils keeps them, starting empty."""
    fake: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    monkeypatch.setattr("torch._dynamo.utils.counters", fake)
    return fake


@pytest.mark.parametrize(
    ("lookups", "served"),
    [
        ({("aot_autograd", "autograd_cache_hit"): 1, ("inductor", "fxgraph_cache_hit"): 2}, True),  # a warm folder
        ({("inductor", "fxgraph_cache_hit"): 1, ("inductor", "fxgraph_cache_miss"): 1}, True),  # in part: not cold
        ({("aot_autograd", "autograd_cache_miss"): 1, ("inductor", "fxgraph_cache_miss"): 2}, False),  # a new folder
        ({("aot_autograd", "autograd_cache_bypass"): 1, ("inductor", "fxgraph_cache_bypass"): 1}, False),
        ({("inductor", "pattern_matcher_count"): 3}, None),  # no lookup: the caches off, or nothing compiled
    ],
)
def test_a_compile_is_told_served_from_the_caches_by_the_lookups_during_it(counters, lookups, served):
    counters["inductor"]["fxgraph_cache_miss"] = 5  # an earlier row's, before this one started
    before = cache_lookups()
    for (group, name), count in lookups.items():
        counters[group][name] += count
    assert served_from_cache(before, cache_lookups()) is served


def test_a_torch_without_the_counters_says_nothing(monkeypatch):
    assert served_from_cache(None, (1, 0)) is None and served_from_cache((0, 0), None) is None
    monkeypatch.delattr("torch._dynamo.utils.counters")
    assert cache_lookups() is None


def test_a_row_given_an_earlier_rows_compile_is_given_whether_the_caches_served_it():
    def row(name: str, compile_s: float | None, cached: bool | None) -> BenchRow:
        return BenchRow(name, "explicit", "cpu", "fp32", True, False, 32, compile_s=compile_s, compile_cached=cached)

    rows = _with_shared_compiles([row("cpu fp32 compiled b32", 0.3, True), row("auto cpu b32", 0.0, None)])
    assert [(r.compile_s, r.compile_cached) for r in rows] == [(0.3, True), (0.3, True)]


def test_a_compiled_auto_rows_break_even_counts_its_trial_as_it_counts_its_compile():
    from redline.bench.rows import _with_break_even

    def row(name, kind, compile, step_ms, **extra):
        return BenchRow(name, kind, "cpu", "fp32", compile, False, 32, step_ms_p50=step_ms, **extra)

    eager = row("cpu fp32 eager b32", "explicit", False, 20.0)
    compiled = row("cpu fp32 compiled b32", "explicit", True, 10.0, compile_s=10.0)
    auto = row("auto cpu b32", "auto", True, 10.0, compile_s=10.0, trial_s=5.0)
    out = {r.name: r.break_even_steps for r in _with_break_even([eager, compiled, auto])}
    assert out["cpu fp32 compiled b32"] == pytest.approx(1000)  # 10 ms saved a step repays 10 s
    assert out["auto cpu b32"] == pytest.approx(1500)  # and 5 s more of trial
