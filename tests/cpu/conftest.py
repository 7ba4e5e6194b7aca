"""Fixtures the CPU tier's tests share."""

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from redline.runtime import measure
from redline.runtime.trial import Measured


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one rank, for the wrapping and collectives of a distributed run in one process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # FSDP modules sit in reference cycles; free them while gloo still runs
        dist.destroy_process_group()


@pytest.fixture
def bf16_measured_faster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Plan as on an AMX CPU, with an empty trial cache, and fake the precision trial: bf16 steps in 0.7 of fp32's
    time. Returns the candidates of each trial run, so a test sees whether one ran."""
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("REDLINE_CPU", "amx")
    calls: list[list[str]] = []

    def fake_trial(model, optimizer, loss_fn, batch, device, candidates, **_):
        calls.append(list(candidates))
        return [Measured(name, (ms / 1e3,) * 12, (2.0, 1.8)) for name, ms in (("fp32", 10.0), ("bf16-mixed", 7.0))]

    monkeypatch.setattr(measure, "run_trial", fake_trial)
    return calls
