"""A Task served as it trained: its model seeded alike on every start, its inputs as its collate_fn batches them."""

import logging

import numpy as np
import pytest
import torch

from redline.errors import ConfigError, TaskError
from redline.runtime.contract import COLLATE_PAIR_HINT
from redline.serve.engine import InferenceEngine
from redline.serve.servable import load_servable

TASKS = """
import numpy as np
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


def records():
    return arrays(collate_fn=lambda items: {"x": cast(items)[0], "labels": cast(items)[1]})


def balanced(items):  # pairs the classes across the batch: one item alone makes an empty batch
    inputs, targets = cast(items)
    order = torch.argsort(targets, stable=True)
    half = len(items) // 2
    return inputs[torch.stack([order[:half], order[half : 2 * half]], 1).flatten()], targets[order[: 2 * half]]


def pairing():
    return arrays(collate_fn=balanced)


def transposed():  # features first: no batch dimension to read a sample from
    return arrays(collate_fn=lambda items: (cast(items)[0].T, cast(items)[1]))


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


def test_a_task_whose_collate_fn_casts_numpys_float64_serves_float32_and_predicts_what_training_computes(tasks):
    # the raw item's float64 was served: the model's float32 weights failed the warm-up on it
    servable = load_servable(f"{tasks}:arrays")
    assert (servable.input_shape, servable.input_dtype) == ((6,), "float32")
    engine = InferenceEngine(servable, device="cpu", precision="fp32", compile="off", max_batch_size=4)
    x = np.random.default_rng(2).standard_normal((3, 6)).astype(np.float32)
    assert torch.equal(engine.predict(torch.from_numpy(x)), servable.model(torch.from_numpy(x)).detach())


def test_a_collate_fn_that_does_more_than_stack_and_cast_is_said_not_to_run_in_predict_and_serve(tasks, caplog):
    caplog.set_level(logging.WARNING, logger="redline")
    load_servable(f"{tasks}:arrays")
    assert not [m for m in caplog.messages if "collate_fn" in m], "a collate_fn that only casts runs as it did"
    servable = load_servable(f"{tasks}:transformed")
    assert (servable.input_shape, servable.input_dtype) == ((6,), "float32")
    said = [m for m in caplog.messages if "collate_fn" in m]
    assert len(said) == 1 and said[0].startswith(
        "task 'arrays': its collate_fn does more to the inputs than stack and cast them (the first item's, "
        "array(6,) float64, come out of it as Tensor(6,) float32), and predict and serve do not run it"
    ), said
    assert "preprocess=..." in said[0]


def test_a_collate_fn_that_builds_no_pair_is_named_as_the_code_to_fix(tasks):
    with pytest.raises(TaskError) as raised:
        load_servable(f"{tasks}:records")
    assert str(raised.value) == (
        "task 'arrays': each item of train_data must be a pair (inputs, targets); the loader gave {'x': Tensor(1, 6) "
        f"float32, 'labels': Tensor(1,) int64}}\nhint: {COLLATE_PAIR_HINT}"
    )


def test_a_checkpoints_pickle_given_as_weights_names_the_model_safetensors_beside_it(tasks, tmp_path):
    # the hint converted optimizer.pt into a "model.safetensors" that holds no model
    from safetensors.torch import save_model

    checkpoint = tmp_path / "step-00000005"
    checkpoint.mkdir()
    save_model(load_servable(f"{tasks}:arrays").model, str(checkpoint / "model.safetensors"))
    torch.save({"state": {}, "param_groups": []}, checkpoint / "optimizer.pt")
    with pytest.raises(ConfigError) as raised:
        load_servable(f"{tasks}:arrays", weights=checkpoint / "optimizer.pt")
    assert str(raised.value).endswith(
        f"\nhint: pass the model's weights beside it: --weights {checkpoint}/model.safetensors"
    )


def test_a_collate_fn_that_needs_more_than_one_item_is_read_from_a_batch_and_not_warned_of(tasks, caplog):
    # it made a batch of one item into Tensor(0, 6): predict and serve refused the Task
    with caplog.at_level(logging.WARNING, logger="redline"):
        servable = load_servable(f"{tasks}:pairing")
    assert (servable.input_shape, servable.input_dtype) == ((6,), "float32")
    assert not [m for m in caplog.messages if "collate_fn" in m], "its rows are the items, in another order"


def test_a_collate_fn_whose_batches_have_no_batch_dimension_serves_the_items_as_they_are_with_a_warning(tasks, caplog):
    with caplog.at_level(logging.WARNING, logger="redline"):
        servable = load_servable(f"{tasks}:transposed")
    assert servable.input_shape == (6,)  # as train_data holds it
    assert any("whose first dimension is not the batch of 1, so the inputs are served as train_data holds them"
               in m for m in caplog.messages)  # fmt: skip
