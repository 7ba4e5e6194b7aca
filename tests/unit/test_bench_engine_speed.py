"""benchmarks/engine_speed.py: the engines take turns in an order that rotates from round to round."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from engine_speed import time_rounds  # the benchmarks folder is not a package


class Engine:
    """Stands in for an InferenceEngine: notes when its timed block began."""

    def __init__(self, name: str, order: list[str]) -> None:
        self.name, self.order, self.calls = name, order, 0

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        if self.calls % 3 == 0:  # the settling call before each block of 2
            self.order.append(self.name)
        self.calls += 1
        return batch


def test_each_round_starts_with_the_next_engine():
    order: list[str] = []
    engines = {name: Engine(name, order) for name in "abc"}
    time_rounds(engines, torch.zeros(1), rounds=3, calls=2)  # type: ignore[arg-type]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
