"""What engine.predict takes as it is, and what it refuses naming the row: arrays torch cannot share as they are
(reversed views, the other byte order), and integers beyond the input dtype's range in any integer dtype."""

import numpy as np
import pytest
import torch
from torch import nn

from redline.errors import ConfigError
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


@pytest.mark.parametrize("value", [2**63, 2**63 + 5, 2**64 - 1])
@pytest.mark.parametrize("given", [np.array, lambda rows, dtype: torch.tensor(rows, dtype=torch.uint64)])
@pytest.mark.parametrize("input_dtype", ["int64", "int32", "float16"])
def test_a_uint64_beyond_the_input_dtypes_range_is_refused_naming_its_row_not_wrapped_negative(
    value, given, input_dtype
):
    rows = [[1, 2, 3], [value, 1, 1]]
    said = rf"^batch='row 1 holding {value}' is not allowed; expected .* within {input_dtype}'s range"
    with pytest.raises(ConfigError, match=said):
        engine_of(input_dtype).predict(given(rows, np.uint64))


def test_a_uint64_within_the_input_dtypes_range_is_taken_as_it_is():
    rows = np.array([[2**63 - 1, 0, 7]], np.uint64)
    assert engine_of("int64").predict(rows).tolist() == [[float(2**63 - 1), 0.0, 7.0]]
    assert engine_of("float32").predict(rows * 2 + 1).tolist() == [[float(2**64 - 1), 1.0, 15.0]]
