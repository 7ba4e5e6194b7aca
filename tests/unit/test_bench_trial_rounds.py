"""benchmarks/trial_rounds.py: a whole trial's steps replayed under the early decisions, round by round."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import trial_rounds  # the benchmarks folder is not a package
from redline.runtime.trial import Measured


def whole(fp32: list[float], bf16: list[float]) -> list[Measured]:
    """A whole trial's measurements: four rounds of three timed steps each, a round's steps given once."""
    return [
        Measured("fp32", tuple(t for t in fp32 for _ in range(3)), (1.0,)),
        Measured("bf16-mixed", tuple(t for t in bf16 for _ in range(3)), (1.0,)),
    ]


def test_leads_read_only_the_rounds_asked_for():
    measured = whole([1.0, 1.0, 0.9, 1.0], [0.5, 0.8, 0.8, 0.8])
    assert trial_rounds.leads(measured, 1) == [pytest.approx(2.0)]
    assert trial_rounds.leads(measured, 4) == [pytest.approx(0.9 / 0.5)]


@pytest.mark.parametrize(
    ("bf16", "decisive", "expected"),
    [
        ([0.6, 0.6, 0.6, 0.6], 1.5, (1, "bf16-mixed")),  # 1.67x after one round: decided there
        ([0.6, 0.6, 0.6, 0.6], math.inf, (2, "bf16-mixed")),  # without a winner after one: two rounds
        ([0.85, 0.85, 0.85, 0.85], 1.5, (4, "bf16-mixed")),  # 1.18x: every round, then chosen
        ([1.2, 1.2, 1.2, 1.2], 1.5, (1, "fp32")),  # slower: fp32 after one round
    ],
)
def test_early_replays_the_steps_and_stops_where_the_trial_would(bf16, decisive, expected):
    assert trial_rounds.early(whole([1.0] * 4, bf16), decisive) == expected
