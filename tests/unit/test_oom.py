"""is_oom: an allocation failure on any device, and nothing else."""

from __future__ import annotations

import pytest
import torch

from redline.runtime.oom import is_oom


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("MPS backend out of memory (MPS allocated: 9.00 GB)"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried"),
        RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes"),
        MemoryError(),
    ],
)
def test_allocation_failures_are_oom(exc: BaseException) -> None:
    assert is_oom(exc)


def test_a_wrapped_oom_is_found_through_its_cause() -> None:
    outer = RuntimeError("backend compiler failed")
    outer.__cause__ = torch.OutOfMemoryError("CUDA out of memory")
    assert is_oom(outer)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
        ValueError("out of memory"),  # not an error type an allocator raises
        KeyError("memory"),
    ],
)
def test_other_errors_are_not_oom(exc: BaseException) -> None:
    assert not is_oom(exc)


def test_a_cause_cycle_ends() -> None:
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert not is_oom(a)
