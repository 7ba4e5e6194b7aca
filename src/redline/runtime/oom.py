"""Out-of-memory: the one place that tells an allocation failure from any other error, and frees after one.

CUDA raises ``torch.OutOfMemoryError``. MPS and the CPU allocator raise a plain RuntimeError whose
message names the failure (torch's c10 allocators: "MPS backend out of memory", "DefaultCPUAllocator:
can't allocate memory", "not enough memory"); Python's own allocations raise MemoryError. Every
caller asks ``is_oom(exc)`` here rather than matching messages itself.
"""

from __future__ import annotations

import gc

import torch

# The messages of the allocators that do not raise torch.OutOfMemoryError (c10/core/CPUAllocator.cpp,
# aten/src/ATen/mps/MPSAllocator.mm), lower-cased.
_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory", "failed to allocate")


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps: a compiled graph re-raises its kernel's error) is an allocation failure."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError | MemoryError):
            return True
        if isinstance(current, RuntimeError) and any(m in str(current).lower() for m in _MESSAGES):
            return True
        current = getattr(current, "inner_exception", None) or current.__cause__
    return False


def free_memory(device: torch.device) -> None:
    """Give back what a failed step held: collect its garbage (cycles in a traceback), then the allocator's cache."""
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif device.type == "mps" and torch.backends.mps.is_available():
        torch.mps.empty_cache()


def peak_memory_share(device: torch.device) -> float | None:
    """The share of ``device``'s memory the allocator's peak took so far: a GPU's, else None (not known)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(device) / torch.cuda.get_device_properties(device).total_memory
