"""The process-wide settings a run changes (TF32, deterministic algorithms, seeds), entered and left as one context.

torch keeps these settings per process, so a library that sets them quietly changes its caller's
program. The Runtime applies them when it starts and puts the previous values back when it closes;
the Plan lists each (``tf32``, ``deterministic``, ``seed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

import torch

from redline.runtime.seed import seed_everything


@dataclass(frozen=True, kw_only=True)
class ProcessSettings:
    """What a run sets for the whole process while it lasts."""

    tf32: bool = False  # TF32 matmuls and cuDNN convolutions (Ampere and newer)
    deterministic: bool = False  # torch.use_deterministic_algorithms(True): an op without one raises
    seed: int | None = None  # seeds Python, NumPy and torch when the run starts; not undone after

    def enter(self) -> _Applied:
        """Apply the settings; the returned context (or its ``restore()``) puts the previous ones back."""
        applied = _Applied()
        if self.seed is not None:
            seed_everything(self.seed)
        if self.tf32:
            torch.set_float32_matmul_precision("high")
            torch.backends.cudnn.allow_tf32 = True
        if self.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=False)
        return applied


class _Applied:
    """The settings as they were before a run changed them."""

    def __init__(self) -> None:
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.cudnn_tf32 = torch.backends.cudnn.allow_tf32
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.warn_only = torch.is_deterministic_algorithms_warn_only_enabled()

    def restore(self) -> None:
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.backends.cudnn.allow_tf32 = self.cudnn_tf32
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)

    def __enter__(self) -> _Applied:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.restore()
