"""benchmarks/speedup.py: a run leaves the process as it found it; the steady window skips the precision check."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import redline
import speedup  # the benchmarks folder is not a package


def test_an_auto_run_puts_back_the_process_wide_settings_it_changed_before_the_next_run():
    task = redline.load_task("example:chargpt", n_layer=1, n_embd=32, block_size=16)
    assert not torch.are_deterministic_algorithms_enabled()
    speedup.auto(task, torch.device("cpu"), 3, options={"deterministic": True})
    assert not torch.are_deterministic_algorithms_enabled()  # no garbage collection needed first


def test_the_steady_window_starts_after_the_runtimes_precision_check_on_a_short_run(monkeypatch):
    batches = [(None, [0] * 4)] * 100
    clock = iter(range(1000))
    monkeypatch.setattr(speedup.time, "perf_counter", lambda: float(next(clock)))  # ticks 0 (window) and 1 (end)
    timing = speedup._timed_steps(100, batches, lambda *_: None, torch.device("cpu"), 0.0)
    assert speedup.STEADY_FROM == 36  # 18 steps in the rule's precision and 17 in the other: runtime/compile_check.py
    assert timing.steady_samples_per_s == (100 - 36) * 4  # 64 steps of 4 samples, between ticks 0 and 1
