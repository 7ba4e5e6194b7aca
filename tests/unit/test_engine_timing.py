"""The engine's timing of its settings, on a fake clock: a timed step of several calls where one is short, each
setting's time per call as its calls took it."""

import pytest
import torch

from redline.plan.inference import Setting
from redline.serve.measure import MIN_STEP_S, MOST_CALLS, calls_per_step, time_settings


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def runner_taking(clock, seconds, calls=None):
    def run(inputs):
        clock.now += seconds
        if calls is not None:
            calls.append(seconds)
        return inputs.sum(dim=1, keepdim=True)

    return run


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(MIN_STEP_S / 20, 20), (MIN_STEP_S * 3, 1), (MIN_STEP_S, 1), (1e-9, MOST_CALLS), (MIN_STEP_S / 2.5, 3)],
)
def test_a_timed_step_makes_as_many_calls_as_last_the_least_step_time(seconds, expected):
    clock = Clock()
    assert calls_per_step(runner_taking(clock, seconds), torch.zeros(2, 3), sync=lambda: None, clock=clock) == expected


def test_each_setting_is_timed_per_call_in_steps_of_its_own_length():
    clock, calls = Clock(), {"fast": [], "slow": []}
    fast, slow = MIN_STEP_S / 10, MIN_STEP_S * 2
    runners = [
        (Setting("fp32", False), lambda: runner_taking(clock, slow, calls["slow"])),
        (Setting("bf16-true", False), lambda: runner_taking(clock, fast, calls["fast"])),
    ]
    reference, candidate = time_settings(runners, torch.zeros(2, 3), torch.ones(2, 3), sync=lambda: None, clock=clock)
    assert reference.median_s == pytest.approx(slow) and candidate.median_s == pytest.approx(fast)
    assert len(reference.block_s) == len(candidate.block_s) == 5
    assert len(calls["fast"]) > 5 * len(calls["slow"]), "the short call ran ten to a timed step, the long one alone"
