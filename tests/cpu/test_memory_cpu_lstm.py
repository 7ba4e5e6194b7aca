"""A CPU LSTM step traced with what oneDNN's kernel holds: its workspace, its reordered weights, its scratchpad."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from redline.hardware.device import FAKE_CPU_ENV, probe_cpu_isa
from redline.memory.cpu_lstm import LstmLayer
from redline.memory.estimate import estimate_memory
from redline.task import Task

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import memory_accuracy

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
BF16_ON_ONEDNN = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # else torch runs a bf16 LSTM op by op


class Tagger(nn.Module):
    """Embeddings through a recurrent layer (two layers, both directions), the last step into a linear head."""

    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.rnn = cell(16, 32, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(64, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(tokens))
        return self.head(out[:, -1])


def tagger_task(cell: type[nn.Module]) -> Task:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (64, 24), generator=gen)
    data = TensorDataset(tokens, torch.randint(0, 50, (64,), generator=gen))
    return Task(model=lambda: Tagger(cell), loss_fn=F.cross_entropy, train_data=data, batch_size=32, name="tagger")


@pytest.mark.parametrize(
    ("steps", "batch", "inputs", "hidden"),
    [(1, 1, 1, 1), (7, 3, 300, 17), (6, 130, 24, 64), (5, 4, 128, 256)],  # rows padded; a batch past 128; 256 wide
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_workspace_is_the_size_onednn_allocates(steps, batch, inputs, hidden, dtype) -> None:
    if dtype == torch.bfloat16 and not BF16_ON_ONEDNN:
        pytest.skip("this CPU runs bf16 LSTMs op by op, not on oneDNN")
    x = torch.zeros(steps, batch, inputs, dtype=dtype)
    weights = [torch.zeros(4 * hidden, k, dtype=dtype) for k in (inputs, hidden)]
    biases = [torch.zeros(4 * hidden, dtype=dtype)] * 2
    state = torch.zeros(batch, hidden, dtype=dtype)
    with torch.enable_grad():  # in training the kernel returns its workspace
        out = torch.ops.aten.mkldnn_rnn_layer(x, *weights, *biases, state, state, False, [], 2, hidden, 1, True,
                                              False, False, True)  # fmt: skip
    layer = LstmLayer.of((x, *weights), "other")
    assert out[3].numel() == layer.workspace()


@pytest.mark.parametrize(
    ("cell", "precision", "within"),
    [
        (nn.LSTM, "fp32", 0.02),  # fp32 runs oneDNN's reference kernels on every x86 CPU: sized byte for byte
        # bf16 off AMX only (an AMX CPU skips it below): oneDNN's brgemm kernels with avx512_bf16, its reference ones
        # on avx512, op by op without AVX-512
        (nn.LSTM, "bf16-mixed", 0.10),
        (nn.GRU, "fp32", 0.02),  # no oneDNN kernel: the meta kernels' outputs are the allocations
    ],
)
def test_a_recurrent_step_is_estimated_as_the_profiler_measures_it(cell, precision, within, monkeypatch) -> None:
    monkeypatch.delenv(FAKE_CPU_ENV, raising=False)  # the estimate sizes the kernels of the CPU that runs the step
    if precision != "fp32" and probe_cpu_isa()[0] == "amx":
        pytest.skip("AMX's bf16 LSTM kernels are not measured yet: the rule sizes them as on AVX-512 with bf16")
    task = tagger_task(cell)
    predicted, measured = memory_accuracy.compare(task, 32, precision, "cpu")
    assert abs(predicted / measured - 1) <= within, (predicted, measured)


def test_the_cpu_given_decides_which_kernels_a_bf16_lstm_is_sized_for() -> None:
    if not BF16_ON_ONEDNN:
        pytest.skip("this CPU runs bf16 LSTMs op by op, so the trace meets no oneDNN kernel")
    task = tagger_task(nn.LSTM)
    peak = {isa: estimate_memory(task, precision="bf16-mixed", target="cpu", cpu_isa=isa).peak
            for isa in ("avx512_bf16", "amx", "avx512")}  # fmt: skip
    # without bf16 instructions oneDNN runs its reference kernels, whose backward keeps every step's gates
    assert peak["amx"] == peak["avx512_bf16"] < peak["avx512"]
    fp32 = {estimate_memory(task, target="cpu", cpu_isa=isa).peak for isa in ("amx", "avx512", "avx2")}
    assert len(fp32) == 1
