"""A bench row's first step: timed apart from the rest of its warm-up window, any compile in it left out."""

import time
from types import SimpleNamespace

import pytest

from redline.bench.loops import first_step_seconds


class FakeRunner:
    """A row's runner whose step takes ``step_s`` and whose first step compiles for ``compile_s`` (as the Runtime
    counts it), on a fake clock."""

    def __init__(self, clock: list[float], step_s: float, compile_s: float = 0.0) -> None:
        self.clock, self.step_s, self.compile_s, self.compiled, self.steps = clock, step_s, compile_s, 0.0, 0

    def run(self, steps: int) -> float:
        for _ in range(steps):
            if self.steps == 0:
                self.clock[0] += self.compile_s
                self.compiled += self.compile_s
            self.clock[0] += self.step_s
            self.steps += 1
        return 1.0

    def compile_seconds(self) -> float | None:
        return self.compiled or None


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    return now


def test_the_first_step_is_one_step_and_its_compile_is_left_to_the_compile_column(clock):
    runner = FakeRunner(clock, step_s=0.25, compile_s=7.0)
    assert first_step_seconds(runner) == pytest.approx(0.25)  # the 7 s compile is the row's compile_s, counted once
    assert runner.steps == 1 and runner.compiled == 7.0


def test_an_eager_rows_first_step_is_its_whole_time(clock):
    runner = FakeRunner(clock, step_s=0.5)
    assert first_step_seconds(runner) == pytest.approx(0.5) and runner.steps == 1


def test_a_compile_counted_longer_than_the_step_took_gives_no_negative_time(clock):
    runner = FakeRunner(clock, step_s=0.1)
    counted = SimpleNamespace(run=runner.run, compile_seconds=lambda: 3.0 if runner.steps else None)
    assert first_step_seconds(counted) == 0.0
