"""What a model's and a Task's fingerprint (the key of a cached trial or tune) tells apart, and what it does not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from redline.task import model_fingerprint


class Activated(nn.Module):
    """A model whose activation is a setting its forward reads, not a module: its repr and shapes never show it."""

    def __init__(self, act: str = "relu", heads: int = 2) -> None:
        super().__init__()
        self.linear, self.act, self.heads, self._calls = nn.Linear(8, 8), act, heads, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._calls += 1
        return torch.relu(self.linear(x)) if self.act == "relu" else torch.tanh(self.linear(x))


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (lambda: nn.MultiheadAttention(8, 2), lambda: nn.MultiheadAttention(8, 4)),  # same shapes, 2 heads or 4
        (lambda: Activated(act="relu"), lambda: Activated(act="tanh")),
        (lambda: Activated(heads=2), lambda: Activated(heads=4)),
        (lambda: nn.Sequential(Activated(heads=2)), lambda: nn.Sequential(Activated(heads=4))),  # in a submodule
    ],
)
def test_the_fingerprint_tells_apart_models_of_the_same_shapes_whose_settings_differ(one, other):
    """Before, two such models found each other's cached trial and tune: chargpt with 2 heads ran 4 heads' choice."""
    assert model_fingerprint(one()) != model_fingerprint(other())
    assert model_fingerprint(one()) == model_fingerprint(one())


def test_the_fingerprint_leaves_out_the_training_switch_private_state_and_what_is_not_a_plain_value():
    model = Activated()
    before = model_fingerprint(model)
    model(torch.zeros(1, 8))  # a private counter moves
    model.eval()
    model.optimizer_hint = object()  # neither a number, a text, a switch nor None: no stable text to hash
    assert model_fingerprint(model) == before
