"""Looking for a ReduceLROnPlateau, which marks nothing on its optimizer, scans the heap: only where it decides."""

import gc

import pytest

from devices import CPU, H100, MPS
from redline.plan.optimizer import optimizer_facts, resolve_optimizer


@pytest.fixture
def scans(monkeypatch):
    """Count the heap scans (gc.get_referrers calls) a test makes."""
    calls = []
    real = gc.get_referrers

    def counted(*objects):
        calls.append(objects)
        return real(*objects)

    monkeypatch.setattr(gc, "get_referrers", counted)
    return calls


def test_the_heap_is_scanned_only_where_a_scheduler_decides_the_implementation(scans):
    """On MPS, or for an optimizer whose implementation the user set, it is kept as given whatever holds it: a script
    holding millions of objects would pay ~100 ms at setup for nothing. On CUDA and on a CPU (where fused is timed) a
    scheduler keeps it as given, so it is looked for."""
    import torch

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    assert resolve_optimizer(optimizer_facts(optimizer, device=MPS), MPS).value == "as given"
    chosen = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], foreach=False)
    torch.optim.lr_scheduler.ReduceLROnPlateau(chosen)
    assert resolve_optimizer(optimizer_facts(chosen, device=H100), H100).value == "as given"
    assert scans == []
    for device in (H100, CPU):  # it decides there: looked for
        kept = resolve_optimizer(optimizer_facts(optimizer, device=device), device)
        assert kept.value == "as given" and "LR scheduler" in kept.reason
    assert len(scans) == 2
    del plateau


def test_a_dict_holding_the_optimizer_costs_no_second_scan(scans):
    """A script's globals hold its ``optimizer`` variable; only a scheduler's own __dict__ is traced to its owner."""
    import torch

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    namespace = {"optimizer": optimizer, "model": None}
    assert resolve_optimizer(optimizer_facts(optimizer, device=H100), H100).value == "fused"
    assert len(scans) == 1
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    vars(scheduler)  # its __dict__ asked for: the scheduler holds the optimizer through it
    assert optimizer_facts(optimizer, device=H100).has_scheduler
    assert len(scans) == 3  # the optimizer's holders, then the holder of the scheduler's __dict__
    del namespace
