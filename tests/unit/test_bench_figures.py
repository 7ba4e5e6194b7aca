"""The bench's arithmetic and its matrix, on numbers given as data."""

import dataclasses

import pytest

from redline.bench.figures import break_even, paired_interval, percentile, rate, speedup, step_times
from redline.bench.matrix import Setting, expand
from redline.bench.result import BenchRow
from redline.bench.run import _with_estimates
from redline.errors import ConfigError
from redline.hardware.device import DeviceFacts

AMX_CPU = DeviceFacts(type="cpu", name="Xeon", cpu_isa="amx")
AVX2_CPU = DeviceFacts(type="cpu", name="EPYC", cpu_isa="avx2")
H100 = DeviceFacts(type="cuda", name="NVIDIA H100 80GB HBM3", index=0, capability=(9, 0))
V100 = DeviceFacts(type="cuda", name="Tesla V100-SXM2-16GB", index=0, capability=(7, 0))


def test_rate_is_the_median_window_so_one_slow_window_does_not_move_it():
    windows = [0.10, 0.10, 0.11, 0.50]  # one window hit by a neighbour's load
    assert rate(windows, 320) == pytest.approx(320 / 0.105)  # the middle two windows' mean time
    assert rate([], 320) is None


def test_a_rate_agrees_with_the_p50_step_time_for_an_even_count_of_windows():
    windows = [0.2, 0.88]  # a busy machine: two windows far apart
    p50 = percentile(step_times(windows, 4), 50)
    assert p50 is not None and rate(windows, 64 * 4) == pytest.approx(64 / p50)


def test_percentiles_interpolate_between_ranks():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 50) is None
    assert step_times([0.5, 1.0], 5) == [0.1, 0.2]


def test_break_even_counts_the_steps_a_compile_takes_to_repay():
    assert break_even(10.0, 0.020, 0.010) == pytest.approx(1000)  # 10 ms saved a step repays 10 s
    assert break_even(10.0, 0.010, 0.012) is None  # compiled is slower: it never repays
    assert break_even(None, 0.01, 0.005) is None


def test_speedup_needs_both_rates():
    assert speedup(300.0, 100.0) == 3.0
    assert speedup(None, 100.0) is None and speedup(1.0, None) is None and speedup(1.0, 0.0) is None


def test_the_median_speedups_interval_is_read_off_the_rounds_ranks_a_binomial_gives():
    # 20 rounds at 95%: between the 6th smallest and the 6th largest of the round-by-round ratios
    baseline = [2.0] * 20
    windows = [2.0 / r for r in (13, 1, 7, 20, 4, 16, 10, 2, 19, 5, 8, 11, 14, 17, 3, 6, 9, 12, 15, 18)]  # ratios 1-20
    low, high = paired_interval(baseline, windows)
    assert (low, high) == (pytest.approx(6.0), pytest.approx(15.0))
    # a round's ratio is its own: a slow round of the baseline is a slow round of the row too, and cancels
    assert paired_interval([1.0, 3.0, 1.0, 3.0, 1.0, 3.0], [0.5, 1.5, 0.5, 1.5, 0.5, 1.5]) == (2.0, 2.0)


def test_the_ranks_of_thousands_of_rounds_agree_with_exact_binomial_sums():
    from fractions import Fraction
    from math import comb

    from redline.bench.figures import _order_rank

    def exact(n: int) -> int:
        below, rank = Fraction(0), 0
        for i in range(n + 1):
            below += Fraction(comb(n, i), 2**n)
            if below > Fraction(1, 40):
                break
            rank = i + 1
        return rank

    assert [_order_rank(n, 0.025) for n in (20, 400, 1500)] == [exact(n) for n in (20, 400, 1500)]
    assert abs(_order_rank(40_000, 0.025) - (20_000 - 1.96 * 100)) <= 1  # 2**40000 overflowed a float's range


def test_too_few_rounds_give_no_interval_and_rounds_one_side_lacks_are_left_out():
    assert paired_interval([1.0] * 5, [1.0] * 5) is None  # P(all five on one side) = 1/16 > 5%
    assert paired_interval([1.0] * 6, [0.5] * 6) == (2.0, 2.0)
    assert paired_interval([1.0] * 9, [0.5] * 5) is None  # a row that failed after five rounds: five pairs
    assert paired_interval([1.0, 0.0] * 3, [0.5] * 6) is None  # a window of no time is no measurement


def test_expand_gives_naive_then_the_matrix_then_auto_per_device_and_size():
    rows = expand([AMX_CPU, H100], precisions=None, compiles=[False, True], batch_sizes=[32, 64])
    names = [row.name for row in rows if row.batch_size == 32]
    assert names == [
        "naive cpu fp32 b32",
        "cpu fp32 eager b32", "cpu fp32 compiled b32", "cpu bf16-mixed eager b32", "cpu bf16-mixed compiled b32",
        "auto cpu b32",
        "naive cuda:0 fp32 b32",
        "cuda:0 fp32 eager b32", "cuda:0 fp32 compiled b32",
        "cuda:0 bf16-mixed eager b32", "cuda:0 bf16-mixed compiled b32",
        "auto cuda:0 b32",
    ]  # fmt: skip
    assert len(rows) == 2 * len(names)
    assert len({row.name for row in rows}) == len(rows)


def test_default_precisions_are_the_ones_the_device_runs_fast():
    def precisions(facts):
        return [r.precision for r in expand([facts], precisions=None, compiles=[False], batch_sizes=[8])]

    assert precisions(AVX2_CPU) == ["fp32", "fp32", "auto"]  # naive, fp32, auto: bf16 is ~30x slower there
    assert precisions(V100) == ["fp32", "fp32", "fp16-mixed", "auto"]
    assert precisions(AMX_CPU) == ["fp32", "fp32", "bf16-mixed", "auto"]


def test_expand_refuses_what_cannot_be_benched():
    with pytest.raises(ConfigError, match=r"hint: e\.g\. --precision"):
        expand([AMX_CPU], precisions=["fp8"], compiles=[False], batch_sizes=[8])
    with pytest.raises(ConfigError, match=r"hint: did you mean bf16-mixed\?"):
        expand([AMX_CPU], precisions=["bf16"], compiles=[False], batch_sizes=[8])
    with pytest.raises(ConfigError, match=r"hint: e\.g\. batch_sizes=\[32, 64\]"):
        expand([AMX_CPU], precisions=None, compiles=[False], batch_sizes=[0])
    with pytest.raises(ConfigError, match="hint: pass --devices"):
        expand([], precisions=None, compiles=[False], batch_sizes=[8])
    with pytest.raises(ConfigError, match=r"compiles=\['off'\] is not allowed; expected a list of True"):
        expand([AMX_CPU], precisions=None, compiles=["off"], batch_sizes=[8])  # type: ignore[list-item]
    only_baselines = expand([AMX_CPU], precisions=None, compiles=[], batch_sizes=[8])
    assert [row.kind for row in only_baselines] == ["naive", "auto"]


def test_a_setting_names_itself():
    assert Setting("explicit", "cpu", "bf16-mixed", True, 64).name == "cpu bf16-mixed compiled b64"
    assert Setting("auto", "cuda:0", "auto", None, 16).name == "auto cuda:0 b16"


def test_a_failed_row_gets_no_memory_estimate_though_a_row_of_its_settings_ran():
    # the failed compiled row showed the eager row's 3264 bytes, where its every other figure was null
    asked = []

    def estimate(batch_size: int, precision: str, device_type: str) -> int:
        asked.append((batch_size, precision, device_type))
        return 3264

    ran = BenchRow("cpu fp32 eager b32", "explicit", "cpu", "fp32", False, False, 32)
    failed = dataclasses.replace(ran, name="cpu fp32 compiled b32", compile=True, error="RuntimeError: no compile")
    rows = _with_estimates([ran, failed], estimate)
    assert [row.estimate_bytes for row in rows] == [3264, None] and asked == [(32, "fp32", "cpu")]
    assert _with_estimates([failed], estimate)[0].estimate_bytes is None
