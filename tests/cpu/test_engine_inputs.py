"""What engine.predict takes as it is, and what it refuses naming the row: arrays torch cannot share as they are
(reversed views, the other byte order), and integers beyond the input dtype's range in any integer dtype."""

import numpy as np
import pytest
import torch
from torch import nn

from redline.serve.engine import InferenceEngine

BATCH = np.arange(12, dtype=np.float32).reshape(4, 3)


class AsFloats(nn.Module):
    def forward(self, x):
        return x.float()


def engine_of(input_dtype="float32"):
    return InferenceEngine(AsFloats(), input_shape=(3,), input_dtype=input_dtype, device="cpu", precision="fp32",
                           compile="off", max_batch_size=4)  # fmt: skip


@pytest.mark.parametrize(
    "view",
    [lambda x: x[::-1], lambda x: x[..., ::-1], np.flip, lambda x: x.astype(">f4"), lambda x: x[::-1].astype(">f8")],
    ids=["rows reversed", "columns reversed", "np.flip", "big-endian", "reversed and big-endian"],
)
def test_predict_takes_a_reversed_view_or_the_other_byte_order_with_its_values_unchanged(view):
    given = view(BATCH)
    expected = torch.tensor(np.array(given, dtype=np.float32))  # a native, contiguous copy of the same values
    torch.testing.assert_close(engine_of().predict(given), expected, rtol=0, atol=0)
