"""A batch that is not an (inputs, targets) pair is blamed on the code that built it: the dataset or a collate_fn."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from redline.errors import TaskError
from redline.runtime.contract import COLLATE_PAIR_HINT, PAIR_HINT, split_batch

DATA = TensorDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))


def records(items):
    return {"x": torch.stack([x for x, _ in items]), "labels": torch.stack([y for _, y in items])}


def hint(batch, **collate_fn):
    with pytest.raises(TaskError) as raised:
        split_batch(batch, "train_data", **collate_fn)
    return str(raised.value).split("\nhint: ")[1]


def test_a_batch_built_by_the_users_collate_fn_names_the_collate_fn_not_the_datasets_getitem():
    loader = DataLoader(DATA, batch_size=2, collate_fn=records)
    assert hint(next(iter(loader)), collate_fn=loader.collate_fn) == COLLATE_PAIR_HINT


def test_a_batch_of_torchs_default_collation_names_the_datasets_getitem():
    loader = DataLoader([torch.zeros(3)] * 4, batch_size=2)  # items that are bare tensors
    assert hint(next(iter(loader)), collate_fn=loader.collate_fn) == PAIR_HINT


def test_a_batch_whose_collation_is_not_told_names_both():
    assert hint({"x": torch.zeros(2, 3)}) == f"{PAIR_HINT}, or from the collate_fn where one builds the batches"
