"""A CPU step traced as the Runtime runs it: the layout its CPU gets, and the copies its pooling backwards make."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import TensorDataset

from redline.errors import ConfigError
from redline.hardware.device import probe_cpu_isa
from redline.memory.cpu_ops import CpuKernels
from redline.memory.estimate import estimate_memory
from redline.memory.trace import LiveBytes
from redline.task import Task, load_task

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import memory_accuracy

N, C, H = 8, 16, 8
NCHW, NHWC = torch.contiguous_format, torch.channels_last
Pool = Callable[[torch.Tensor], torch.Tensor]
Layout = torch.memory_format
POOLS: dict[str, Pool] = {
    "max_pool2d": lambda x: F.max_pool2d(x, 2),
    "avg_pool2d": lambda x: F.avg_pool2d(x, 2),
    "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, 2),
}


def pool_step(pool: Pool, x: torch.Tensor, grad_layout: Layout) -> None:
    out = pool(x)
    out.backward(torch.ones(out.shape).contiguous(memory_format=grad_layout))


def measured(pool: Pool, layout: Layout, grad: Layout) -> int:
    """The peak of a pooling step run for real, from the profiler's memory events."""
    x = torch.randn(N, C, H, H).contiguous(memory_format=layout).requires_grad_()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pool_step(pool, x, grad)
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())  # type: ignore[union-attr]
    current = peak = 0
    for event in events:
        if event.name() == "[memory]":
            current += event.nbytes()
            peak = max(peak, current)
    return peak


def traced(pool: Pool, layout: Layout, grad: Layout) -> int:
    """The peak of the same step traced on fake tensors, the CPU kernels' copies counted."""
    mode, tracker = FakeTensorMode(), LiveBytes()
    with mode:
        x = torch.empty(N, C, H, H, memory_format=layout, requires_grad=True)
        with tracker, CpuKernels():
            pool_step(pool, x, grad)
    return tracker.peak


@pytest.mark.parametrize("name", POOLS)
@pytest.mark.parametrize(("layout", "grad"), [(NHWC, NCHW), (NCHW, NHWC), (NHWC, NHWC), (NCHW, NCHW)])
def test_a_pooling_backward_holds_the_copies_its_cpu_kernel_makes(name, layout, grad) -> None:
    pool = POOLS[name]
    assert traced(pool, layout, grad) == measured(pool, layout, grad)
    if layout != grad:  # a copy of the input's gradient (fp32), and max pooling's of its int64 indices
        copies = N * C * H * H * 4 + (N * C * (H // 2) ** 2 * 8 if name == "max_pool2d" else 0)
        assert traced(pool, layout, grad) - traced(pool, layout, layout) == copies


def test_on_amx_a_bf16_cnn_is_traced_channels_last_with_its_pooling_copies() -> None:
    # the digits CNN: conv(1->32), conv(32->64), max-pool 8x8 -> 4x4, flatten, linear. On AMX the Runtime lays
    # it out NHWC; the flatten's gradient comes back NCHW, so the max-pool's backward copies its bf16 gradient
    # (64 channels of 8x8) and its int64 indices (64 channels of 4x4)
    task, batch = load_task("example:digits"), 128
    amx = estimate_memory(task, batch_size=batch, precision="bf16-mixed", target="cpu", cpu_isa="amx")
    avx2 = estimate_memory(task, batch_size=batch, precision="bf16-mixed", target="cpu", cpu_isa="avx2")
    assert amx.peak - avx2.peak == batch * 64 * 8 * 8 * 2 + batch * 64 * 4 * 4 * 8
    assert any("channels_last" in note and "the CPU given (amx)" in note for note in amx.notes), amx.notes
    assert not any("channels_last" in note for note in avx2.notes)
    fp32 = [estimate_memory(task, batch_size=batch, target="cpu", cpu_isa=isa) for isa in ("amx", "avx2")]
    assert fp32[0].peak == fp32[1].peak  # in fp32 the Runtime keeps NCHW on every CPU
    assert not any("channels_last" in note for note in fp32[0].notes)


def test_a_model_without_convolutions_is_traced_as_it_is_on_amx() -> None:
    data = TensorDataset(torch.randn(64, 32), torch.randint(0, 4, (64,)))
    task = Task(model=lambda: torch.nn.Linear(32, 4), loss_fn=F.cross_entropy, train_data=data, batch_size=16)
    amx, avx2 = (estimate_memory(task, precision="bf16-mixed", target="cpu", cpu_isa=isa) for isa in ("amx", "avx2"))
    assert amx == avx2


def test_the_cpu_is_this_machines_unless_given_and_redline_cpu_fakes_it(monkeypatch) -> None:
    monkeypatch.setenv("REDLINE_CPU", "amx")
    task = load_task("example:digits")
    faked = estimate_memory(task, batch_size=64, precision="bf16-mixed", target="cpu")
    given = estimate_memory(task, batch_size=64, precision="bf16-mixed", target="cpu", cpu_isa="amx")
    assert faked.peak == given.peak
    assert any("the CPU REDLINE_CPU fakes (amx)" in note for note in faked.notes), faked.notes
    with pytest.raises(ConfigError, match="cpu_isa"):
        estimate_memory(task, target="cpu", cpu_isa="sse")  # type: ignore[arg-type]


def test_on_a_cpu_with_amx_a_bf16_cnn_is_estimated_within_five_percent_of_the_profiler(monkeypatch) -> None:
    monkeypatch.delenv("REDLINE_CPU", raising=False)
    if probe_cpu_isa()[0] != "amx":  # the Runtime would lay it out NCHW, and bf16 convolutions run other kernels
        pytest.skip("needs a CPU with AMX, where the Runtime lays a bf16 CNN out channels_last")
    task = load_task("example:digits")
    for batch in (64, 256):
        estimate = estimate_memory(task, batch_size=batch, precision="bf16-mixed", target="cpu")
        real = memory_accuracy.measured_peak(task, batch, "bf16-mixed", "cpu")
        assert abs(estimate.peak / real - 1) <= 0.05, (batch, estimate.peak, real)
