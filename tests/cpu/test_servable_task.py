"""A Task served as it trained: its model seeded alike on every start, its inputs as its collate_fn batches them."""

import pytest
import torch

from redline.serve.servable import load_servable

TASKS = """
import torch
import redline
from torch import nn
from torch.utils.data import Dataset, TensorDataset

X = np.random.default_rng(0).standard_normal((16, 6))  # float64, as NumPy makes them
Y = np.random.default_rng(1).integers(0, 3, 16)


class Arrays(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return X[i], Y[i]


def cast(items):
    return torch.tensor(np.stack([x for x, _ in items]), dtype=torch.float32), torch.tensor([y for _, y in items])


def doubled(items):
    inputs, targets = cast(items)
    return inputs * 2, targets


def arrays(collate_fn=cast):
    return redline.Task(name="arrays", model=lambda: nn.Linear(6, 3), loss_fn=nn.functional.cross_entropy,
                        train_data=Arrays(), collate_fn=collate_fn, batch_size=4)


def transformed():
    return arrays(collate_fn=doubled)


def module():
    return redline.Task(name="module", model=nn.Linear(6, 3), loss_fn=nn.functional.cross_entropy,
                        train_data=TensorDataset(torch.randn(8, 6), torch.zeros(8, dtype=torch.long)))
"""


@pytest.fixture
def tasks(tmp_path):
    (tmp_path / "tasks.py").write_text(TASKS)
    return str(tmp_path / "tasks.py")


def test_a_task_given_a_module_is_the_same_untrained_model_on_every_start(tasks):
    # the module is built in the factory: it was built before the seed, so each start answered differently
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    first, again = (load_servable(f"{tasks}:module").model.state_dict() for _ in range(2))
    assert all(torch.equal(value, again[name]) for name, value in first.items())
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's random state is left alone"
