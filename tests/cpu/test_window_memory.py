"""Peak memory per log window: a spike shows in its own window's mem_gib and not in the next one's."""

import csv

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import redline
from redline.hardware.memory import WindowPeak, resident_peak_bytes
from redline.train.trainer import Trainer

MIB = 2**20
SPIKE = 256 * MIB  # above glibc's largest mmap threshold (32 MiB): freed straight back to the kernel


def spike() -> None:
    big = torch.ones(SPIKE // 4)  # every page written, so every page is resident
    del big


def resident_windows() -> WindowPeak:
    peak = WindowPeak(torch.device("cpu"))
    if peak.kind != "resident":
        pytest.skip(f"this kernel keeps no resettable resident peak here ({peak.kind}): /proc/self/clear_refs")
    return peak


def test_a_spike_shows_in_its_window_and_not_in_the_next():
    peak = resident_windows()
    peak.read()
    spike()
    spiked = peak.read()
    after = peak.read()
    assert spiked is not None and after is not None
    assert spiked - after > 0.9 * SPIKE
    assert resident_peak_bytes() < spiked  # the reset is the kernel's own: VmHWM itself went down


def test_the_trainer_logs_each_windows_own_peak(tmp_path):
    resident_windows()
    steps = {"n": 0}

    class SpikeAtStep3(nn.Linear):
        def forward(self, x):
            if not x.is_meta and torch.is_grad_enabled():  # training steps only (the FLOP count runs on meta)
                steps["n"] += 1
                if steps["n"] == 3:
                    spike()
            return super().forward(x)

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=gen), torch.randint(0, 2, (64,), generator=gen))
    task = redline.Task(model=lambda: SpikeAtStep3(4, 2), loss_fn=nn.functional.cross_entropy, train_data=data)
    options = redline.RuntimeOptions(devices="cpu", seed=0)
    Trainer(task, runtime=options, max_steps=5, log_every=1, progress=False, out_dir=tmp_path).fit()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    mem = [float(r["mem_gib"]) * 2**30 for r in rows]
    assert len(mem) == 5
    assert mem[2] - mem[3] > 0.9 * SPIKE and mem[2] - mem[1] > 0.9 * SPIKE  # step 3's window only
    assert abs(mem[3] - mem[4]) < 0.5 * SPIKE


def test_a_cuda_window_reads_the_allocators_peak_then_starts_it_again(monkeypatch):
    allocator = {"now": 100, "peak": 900}
    resets = []

    def reset(device):
        resets.append(device)
        allocator["peak"] = allocator["now"]

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocator["peak"])
    cuda = torch.device("cuda", 0)
    peak = WindowPeak(cuda)  # the first window starts clean: what ran before is not counted
    allocator["peak"] = 700
    assert (peak.kind, peak.read(), peak.read()) == ("allocated", 700, 100)
    assert resets == [cuda, cuda, cuda]
