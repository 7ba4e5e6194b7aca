"""The CUDA workspaces a training step holds beside its tensors: cuBLAS's, one for each thread that runs matmuls.

torch gives each thread its own cuBLAS handle (a thread-local pool) and each handle, per stream, a workspace
it allocates through the caching allocator and keeps for the life of the process
(aten/src/ATen/cuda/CublasHandlePool.cpp). A training step runs matmuls on two threads: the forward (and
the loss and the optimizer step) on the caller's, the backward on autograd's own thread for the device
(autograd runs a CUDA graph's backward on a worker thread per device). So a model whose forward and backward
both multiply matrices holds two workspaces. A linear layer with a bias goes through cuBLASLt in the
forward. Measured on an H200 (torch 2.11): an MLP's step held 65 MiB above its tensors, at every batch size
and precision: two cuBLAS workspaces, and 1 MiB that matches cuBLASLt's default workspace, kept apart from
cuBLAS's where torch does not unify the two (TORCH_CUBLASLT_UNIFIED_WORKSPACE; releases differ).

cuDNN's convolution workspace is not counted: cuDNN allocates it for the length of one call, sized by the
algorithm it picks on the device, and the digits CNN's step showed under 1 MiB of it on the H200.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MIB = 2**20
# cuBLAS's workspace per handle: 32 MiB on Hopper and newer (getChosenWorkspaceSize, CUBLAS_WORKSPACE_CONFIG
# overrides it), 8 MiB and 128 KiB on older GPUs: the larger is allowed, the GPU being unknown here.
CUBLAS_WORKSPACE = 32 * MIB
# cuBLASLt's own workspace per handle (CUBLASLT_WORKSPACE_SIZE, 1024 KiB by default), unless
# TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 makes it share cuBLAS's.
CUBLASLT_WORKSPACE = 1 * MIB

_aten = torch.ops.aten
# The ops that run on cuBLAS on a GPU (what linear, matmul, einsum and bmm come down to).
_CUBLAS = frozenset(
    {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.addbmm, _aten.mv, _aten.addmv, _aten.dot, _aten.vdot}
    | {_aten._addmm_activation}
)
# A matrix product plus a bias vector (a linear layer's forward): torch runs it through cuBLASLt's fused epilogue.
_CUBLASLT = frozenset({_aten.addmm, _aten._addmm_activation})


class MatmulThreads(TorchDispatchMode):
    """Note which threads of a CUDA step run cuBLAS and cuBLASLt: the caller's, and autograd's during
    ``on_autograd_thread``; ``workspace`` is what they hold."""

    def __init__(self) -> None:
        super().__init__()
        self._thread = "caller"
        self.cublas: set[str] = set()
        self.cublaslt: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = func.overloadpacket
        if packet in _CUBLAS:
            self.cublas.add(self._thread)
            if packet in _CUBLASLT and args[0].dim() == 1:  # a bias vector; a full matrix takes plain cuBLAS
                self.cublaslt.add(self._thread)
        return func(*args, **(kwargs or {}))

    @contextmanager
    def on_autograd_thread(self) -> Iterator[None]:
        """Count the matmuls run inside as autograd's thread's (a backward, recomputed forwards included)."""
        self._thread = "autograd"
        try:
            yield
        finally:
            self._thread = "caller"

    @property
    def workspace(self) -> int:
        """The bytes of the workspaces these threads hold: cuBLAS's and cuBLASLt's, one each per thread."""
        return len(self.cublas) * CUBLAS_WORKSPACE + len(self.cublaslt) * CUBLASLT_WORKSPACE
