"""What a model's and a Task's fingerprint (the key of a cached trial or tune) tells apart, and what it does not."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset, default_collate

from redline.task import Task, model_fingerprint
from redline.train import agreement
from redline.train.config import TrainerConfig


class Activated(nn.Module):
    """A model whose activation is a setting its forward reads, not a module: its repr and shapes never show it."""

    def __init__(self, act: str = "relu", heads: int = 2, shift: float = 0.0) -> None:
        super().__init__()
        self.linear, self.act, self.heads, self._shift = nn.Linear(8, 8), act, heads, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.relu(self.linear(x)) if self.act == "relu" else torch.tanh(self.linear(x))) + self._shift


def relu_net() -> nn.Module:
    class Net(Activated):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x))

    return Net()


def gelu_net() -> nn.Module:
    class Net(Activated):  # the same name, shapes and settings: only the forward's code tells them apart
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(self.linear(x))

    return Net()


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (lambda: nn.MultiheadAttention(8, 2), lambda: nn.MultiheadAttention(8, 4)),  # same shapes, 2 heads or 4
        (lambda: Activated(act="relu"), lambda: Activated(act="tanh")),
        (lambda: Activated(heads=2), lambda: Activated(heads=4)),
        (lambda: nn.Sequential(Activated(heads=2)), lambda: nn.Sequential(Activated(heads=4))),  # in a submodule
        (relu_net, gelu_net),  # F.relu edited into F.gelu
    ],
)
def test_the_fingerprint_tells_apart_models_of_the_same_shapes_whose_settings_differ(one, other):
    """Before, two such models found each other's cached trial and tune: chargpt with 2 heads ran 4 heads' choice;
    a model whose forward's code changed ran the other's."""
    assert model_fingerprint(one()) != model_fingerprint(other())
    assert model_fingerprint(one()) == model_fingerprint(one())


def test_the_fingerprint_leaves_out_the_training_switch_private_state_and_what_is_not_a_plain_value():
    model = nn.Sequential(Activated())
    before = model_fingerprint(model)
    model.eval()
    model[0]._calls = 3  # private state
    model[0].optimizer_hint = object()  # neither a number, a text, a switch nor None: no stable text to hash
    for _ in range(10):  # the interpreter specialises the forward's bytecode as it runs: not what is hashed
        model(torch.zeros(1, 8))
    assert model_fingerprint(model) == before


class Stamped(nn.Linear):
    """A model keeping private state of each instance: when it was built, and a cache its forward sets."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self._built_at, self._seq_len_cached = time.time(), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._seq_len_cached = x.shape[0]
        return super().forward(x)


def test_the_fingerprint_is_stable_for_a_model_keeping_private_state_of_each_instance():
    """Private attributes counted in the key for a while: a model stamped as it was built paid a trial every run,
    and one that ran its forward, or that torch.compile marked (``_is_torch_compile``), read as another model."""
    assert model_fingerprint(Stamped()) == model_fingerprint(Stamped())
    model = Stamped()
    before = model_fingerprint(model)
    model(torch.zeros(3, 4))
    torch.compile(model)
    assert model_fingerprint(model) == before


def test_the_fingerprint_is_the_same_in_another_process():
    """The code is hashed by its bytecode, names and constants: a code object's repr holds a memory address, and a
    set constant's order follows string hashes, seeded per process (PYTHONHASHSEED)."""
    script = textwrap.dedent(
        """
        import torch
        from torch import nn
        from torch.utils.data import TensorDataset
        from redline import Task

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc, self._act = nn.Linear(4, 4), "gelu"

            def forward(self, x):
                if self._act in {"gelu", "tanh", "silu", "mish"}:
                    return sum(f(x) for f in (lambda y: self.fc(y), lambda y: y * 2.5))
                return self.fc(x)

        data = TensorDataset(torch.zeros(8, 4), torch.zeros(8, 4))
        loss = lambda out, target: ((out - target) ** 2).mean() if {"a", "b", "c"} else None
        print(Task(model=Net, loss_fn=loss, train_data=data, collate_fn=lambda items: items[0]).fingerprint())
        """
    )
    seen = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
        seen.add(run.stdout)
    assert len(seen) == 1 and len(seen.pop().strip()) == 16


def test_a_tasks_fingerprint_tells_apart_losses_and_collate_fns_by_their_code():
    """Two lambdas of one function share a module and a name: before, the one's cached trial answered the other."""
    data = TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))

    def task(**fields: object) -> Task:
        return Task(**{"model": lambda: nn.Linear(4, 4), "loss_fn": F.cross_entropy, "train_data": data, **fields})

    losses = [lambda o, t: F.cross_entropy(o, t), lambda o, t: F.multi_margin_loss(o, t)]
    assert len({task(loss_fn=loss).fingerprint() for loss in losses}) == 2
    partials = [functools.partial(loss) for loss in losses]
    assert len({task(loss_fn=loss).fingerprint() for loss in partials}) == 2
    stacked = [lambda items: default_collate(items), lambda items: default_collate(items[::-1])]
    assert len({task(collate_fn=collate).fingerprint() for collate in stacked}) == 2
    assert task(loss_fn=losses[0]).fingerprint() == task(loss_fn=losses[0]).fingerprint()


def test_the_ranks_model_check_leaves_the_forward_code_out_which_other_python_versions_compile_apart():
    assert model_fingerprint(relu_net()) != model_fingerprint(gelu_net())
    assert model_fingerprint(relu_net(), code=False) == model_fingerprint(gelu_net(), code=False)
    shared, other = (
        agreement.settings(TrainerConfig(), Task(model=net, loss_fn=F.cross_entropy, train_data=[0]), net())
        for net in (relu_net, gelu_net)
    )
    assert shared["model (structure and shapes)"] == other["model (structure and shapes)"]
