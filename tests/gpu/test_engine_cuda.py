"""The InferenceEngine on a CUDA device: one CUDA graph per bucket, equal to eager, outputs that stay put."""

import pytest
import torch
from torch import nn

from redline.serve.engine import InferenceEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 10)
    )  # fmt: skip


def engine(model: nn.Module, **options) -> InferenceEngine:
    options = {"device": "cuda", "precision": "fp32", "compile": "off", "channels_last": "off", "max_batch_size": 8,
               **options}  # fmt: skip
    return InferenceEngine(model, input_shape=(1, 8, 8), **options)


def test_each_bucket_is_a_captured_graph_whose_outputs_equal_eager():
    model = small_cnn()
    graphs = engine(model, cuda_graphs="on")
    eager = engine(small_cnn(), cuda_graphs="off")
    graphs.warm_up()
    eager.warm_up()
    assert graphs.plan["cuda_graphs"].value is True
    assert sorted(graphs._runner_of(graphs.buckets[-1]).captured) == [1, 2, 4, 8], (
        "every bucket was captured at warm-up"
    )
    inputs = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    for rows in (1, 3, 4, 7, 8):
        out = graphs.predict(inputs[:rows])
        assert out.shape == (rows, 10) and out.device.type == "cpu"
        torch.testing.assert_close(out, eager.predict(inputs[:rows]), rtol=1e-5, atol=1e-5)


def test_a_later_replay_does_not_overwrite_outputs_already_returned():
    graphs = engine(small_cnn(), cuda_graphs="on")
    graphs.warm_up()
    first_inputs, second_inputs = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)
    first = graphs.predict(first_inputs)
    kept = first.clone()
    second = graphs.predict(second_inputs)  # the same bucket's graph, replayed on other inputs
    assert torch.equal(first, kept), "the first outputs were copied out, not left in the graph's buffer"
    assert not torch.equal(first, second)


def test_auto_turns_graphs_on_for_cuda_and_measures_with_them():
    auto = engine(small_cnn(), precision="auto", compile="off")
    assert auto.plan["cuda_graphs"].value is True
    assert "measured" in auto.plan and "largest bucket (8)" in auto.plan["measured"].reason
    auto.warm_up()
    out = auto.predict(torch.zeros(3, 1, 8, 8))
    assert out.shape == (3, 10) and torch.isfinite(out).all()


def test_compile_and_graphs_together_match_eager():
    model = small_cnn()
    compiled = engine(model, compile="on", cuda_graphs="on", max_batch_size=2)
    if not compiled.plan["compile"].value:
        pytest.skip(compiled.plan["compile"].reason)
    compiled.warm_up()
    assert compiled.plan["compile"].value is True, compiled.plan["compile"].reason
    inputs = torch.randn(2, 1, 8, 8)
    expected = engine(small_cnn(), cuda_graphs="off", max_batch_size=2).predict(inputs)
    torch.testing.assert_close(compiled.predict(inputs), expected, rtol=1e-4, atol=1e-4)


def test_a_forward_that_syncs_with_the_cpu_falls_back_to_eager_with_the_reason():
    class Syncing(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x):
            if x.sum().item() > 1e30:  # .item() waits for the device: not capturable
                return x[:, :2]
            return self.linear(x)

    fallback = InferenceEngine(Syncing(), input_shape=(4,), device="cuda", precision="fp32", compile="off",
                               cuda_graphs="on", max_batch_size=2)  # fmt: skip
    fallback.warm_up()
    assert fallback.plan["cuda_graphs"].value is False
    assert "capture failed" in fallback.plan["cuda_graphs"].reason
    assert fallback.broken is None
    assert fallback.predict(torch.ones(2, 4)).shape == (2, 2)


def test_bf16_weights_in_channels_last_replay_as_graphs_close_to_fp32():
    fast = engine(small_cnn(), precision="bf16-true", channels_last="on", cuda_graphs="on")
    fast.warm_up()
    weight = fast.model[0].weight  # (8, 1, 3, 3): channels_last puts the channel stride at 1, NCHW at 9
    assert weight.dtype == torch.bfloat16 and weight.stride(1) == 1
    inputs = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    expected = engine(small_cnn(), cuda_graphs="off").predict(inputs)
    out = fast.predict(inputs)
    assert out.dtype == torch.float32 and out.shape == (5, 10)
    assert (out - expected).abs().max() <= 0.02 * expected.abs().max()


def test_auto_times_both_weight_formats_and_layouts_with_graphs():
    auto = engine(small_cnn(), precision="auto", compile="off", channels_last="auto")
    timed = auto.plan["measured"].reason
    assert all(label in timed for label in ("bf16-true", "fp32+channels_last", "bf16-true+channels_last")), timed
    auto.warm_up()
    for bucket in auto.buckets:  # small buckets may run another setting (small_batches), each its own graphs
        assert bucket in auto._runner_of(bucket).captured, auto.plan["small_batches"]
    inputs = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    expected = engine(small_cnn(), cuda_graphs="off").predict(inputs)
    for rows in (1, 2, 3, 8):
        out = auto.predict(inputs[:rows])
        assert (out - expected[:rows]).abs().max() <= 0.02 * expected.abs().max()
