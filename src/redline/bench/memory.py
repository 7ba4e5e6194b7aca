"""Peak memory of one bench row while it is built and warmed up: allocated on a GPU, resident on a CPU.

On CUDA the allocator's own peak counter is reset first and read after, less what was allocated
before (the other rows' models), so the figure is the row's own: its weights, optimizer state,
activations and workspace (``kind`` "allocated"). A CPU has no such counter: a thread reads the
process's resident set every few milliseconds (Linux's /proc/self/statm) and the figure is its
highest value (``kind`` "resident"): the whole process, earlier rows and the data included. Its
growth alone would mislead, since the allocator reuses what earlier rows freed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType

import torch

from redline.hardware.memory import resident_bytes

INTERVAL_S = 0.002


@dataclass(frozen=True)
class Peak:
    """A row's peak in bytes (None if unknown) and its ``kind``, as ``PeakMemory`` read it (in the row's process)."""

    peak: int | None
    kind: str


class PeakMemory:
    """``with PeakMemory(device) as m: ...``; then ``m.peak`` is the peak in bytes (None if unknown)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak: int | None = None
        self.kind = "allocated" if device.type == "cuda" else "resident"
        self._base = 0
        self._highest = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif self.device.type == "cpu" and (rss := resident_bytes()) is not None:
            self._base = self._highest = rss
            self._thread = threading.Thread(target=self._sample, name="redline-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = self._highest

    def _sample(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            rss = resident_bytes()
            if rss is not None and rss > self._highest:
                self._highest = rss

    def read(self) -> Peak:
        """The peak read, as data that travels from a row's own process."""
        return Peak(self.peak, self.kind)
