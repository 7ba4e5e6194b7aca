"""The process-wide settings a run changes (TF32, deterministic algorithms, seeds, the attention kernel), entered and
left as one context.

torch keeps these settings per process, so a library that sets them quietly changes its caller's
program. The Runtime applies them when it starts and puts the previous values back when it closes;
the Plan lists each (``tf32``, ``deterministic``, ``seed``, ``attention``); deterministic algorithms on CUDA come
with cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG). A setting the run does not change is
neither read nor written. Runtimes that overlap may close in any order (runtime/process_holds.py): a setting stays
while a later Runtime holds it, and what the first found comes back when the last of them closes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from redline.runtime.attention import prefer_kernel
from redline.runtime.process_holds import hold_setting
from redline.runtime.seed import seed_everything


@dataclass(frozen=True, kw_only=True)
class ProcessSettings:
    """What a run sets for the whole process while it lasts."""

    tf32: bool = False  # TF32 matmuls and cuDNN convolutions (Ampere and newer)
    deterministic: bool = False  # torch.use_deterministic_algorithms(True): an op without one raises
    seed: int | None = None  # seeds Python, NumPy and torch when the run starts; not undone after
    attention: str | None = None  # the kernel scaled_dot_product_attention prefers (None: torch picks per call)

    def enter(self) -> contextlib.ExitStack:
        """Apply the settings; closing the returned stack puts the previous ones back."""
        undo = contextlib.ExitStack()
        if self.seed is not None:
            seed_everything(self.seed)
        if self.tf32:
            undo.enter_context(hold_setting("tf32", _tf32_on))
        if self.deterministic:
            undo.enter_context(hold_setting("deterministic", _deterministic_on))
        if self.attention is not None:
            undo.enter_context(prefer_kernel(self.attention))
        return undo


# cuBLAS picks its matmul algorithms per workspace: only a fixed one gives the same result every run, and under
# deterministic algorithms torch refuses every CUDA matmul without it (RuntimeError at the first Linear). It is
# read at the process's first cuBLAS call, so it is set before the run's first step, unless the user set it:
# https://docs.nvidia.com/cuda/cublas/index.html#results-reproducibility
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = ":4096:8"


def _cublas_workspace_fixed() -> Callable[[], None]:
    """Set cuBLAS's deterministic workspace where nothing set one; return what puts the environment back."""
    if CUBLAS_WORKSPACE in os.environ:
        return lambda: None
    os.environ[CUBLAS_WORKSPACE] = CUBLAS_DETERMINISTIC

    def restore() -> None:
        os.environ.pop(CUBLAS_WORKSPACE, None)

    return restore


def _deterministic_on() -> Callable[[], None]:
    """Turn deterministic algorithms on, with cuBLAS's workspace; return what puts both back."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), _warn_only()
    workspace = _cublas_workspace_fixed()
    torch.use_deterministic_algorithms(True, warn_only=False)

    def restore() -> None:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        workspace()

    return restore


def _warn_only() -> bool:
    return torch.is_deterministic_algorithms_warn_only_enabled()


def _tf32_on() -> Callable[[], None]:
    """Turn TF32 on through the API this process already uses; return what turns it back.

    torch 2.9 added per-backend settings (``torch.backends.cuda.matmul.fp32_precision``) and raises
    when a process mixes them with the older global ones, so the setting goes through whichever the
    process has used: https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices
    """
    try:
        matmul = torch.get_float32_matmul_precision()
    except RuntimeError:  # the process set the per-backend API: reading the global one is refused
        return _tf32_on_per_backend()
    cudnn = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True

    def restore() -> None:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn

    return restore


def _tf32_on_per_backend() -> Callable[[], None]:
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv  # type: ignore[attr-defined]
    before = (matmul.fp32_precision, conv.fp32_precision)
    matmul.fp32_precision, conv.fp32_precision = "tf32", "tf32"

    def restore() -> None:
        matmul.fp32_precision, conv.fp32_precision = before

    return restore
