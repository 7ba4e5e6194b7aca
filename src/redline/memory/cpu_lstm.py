"""What a CPU LSTM layer's oneDNN kernel allocates beyond the tensors torch's meta kernel returns.

On a CPU torch runs ``nn.LSTM`` through oneDNN where it can (fp32, and bf16 on a CPU with AVX-512; not with
projections: aten/src/ATen/native/RNN.cpp, ``use_mkldnn``), one ``aten::mkldnn_rnn_layer`` per layer and direction
(aten/src/ATen/native/mkldnn/RNN.cpp). In training its forward also returns oneDNN's workspace, which autograd keeps
until the layer's backward: the gates and states of every time step and room for their gradients, many times the
layer's output. Torch's meta kernel returns it empty (torch/_meta_registrations.py), so a trace missed it; an
embedding and an LSTM(128, 256) at batch 64 measured 5.3 times their estimate. While they run, both calls also
hold the weights reordered into oneDNN's layouts and its scratchpad (the fp32 kernel's keeps the gates of every
step), and the backward fills the gradients autograd leaves undefined, copies the ones that are not contiguous,
and works on fp32 copies of bf16 ones.

The sizes follow oneDNN's layout (src/cpu/rnn/rnn_utils.{hpp,cpp}: each buffer on its own 4 KiB page, rows padded
to 64 bytes and off multiples of 256 elements), checked against what torch 2.13 (oneDNN 3.12) allocates: the
workspace byte for byte at 140 random shapes in fp32 and bf16, the same with oneDNN limited to AVX2 and to AVX-512
without bf16; the reordered weights byte for byte, and the scratchpads within 300 bytes (the brgemm backward's
within 1.5 KiB), at 20 shapes on each kernel. The CPU is given as data: bf16 runs on oneDNN's brgemm kernels where
the CPU has bf16 instructions (``amx``, ``avx512_bf16``; AMX's per-thread tiles are not counted) and on its
reference kernels elsewhere; fp32 runs on the reference kernels on every CPU. An older oneDNN (2.x) laid the
workspace out with two more blocks of states: tests/cpu/test_memory_cpu_lstm.py checks the installed one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from redline.hardware.device import CpuIsa

_PAGE = 4096
_GATES = 4  # an LSTM's: input, forget, cell and output
_FP32 = 4  # oneDNN accumulates, and keeps gradients, in fp32
# Bytes oneDNN books beside an RNN's scratch space (its pointer arrays and their alignment), measured on the fp32
# reference kernels (within 300 bytes on the others).
_BOOKED = 4664
_BRGEMM_BLOCK = 32  # the brgemm kernels' weights are blocked by 32 outputs (forward) or inputs (backward)
_BRGEMM_ISAS: tuple[CpuIsa, ...] = ("amx", "avx512_bf16")
_MERGED_BATCH = 128  # below it the reference forward multiplies every step's input at once (rnn_utils.hpp)


def _pages(size: int) -> int:
    return -(-size // _PAGE) * _PAGE


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _good_ld(dim: int, size: int) -> int:
    """oneDNN's row length for ``dim`` elements of ``size`` bytes (rnn_utils' ``get_good_ld``)."""
    row = _round_up(dim, 64 // size)
    return row + 64 // size if row % 256 == 0 else row


@dataclass(frozen=True)
class LstmLayer:
    """One call of ``mkldnn_rnn_layer``: ``steps`` x ``batch`` inputs of ``inputs`` features into ``hidden``, its
    elements ``size`` bytes (4 fp32, 2 bf16), on oneDNN's brgemm kernels or its reference ones."""

    steps: int
    batch: int
    inputs: int
    hidden: int
    size: int
    brgemm: bool

    @classmethod
    def of(cls, args: Any, cpu_isa: CpuIsa) -> LstmLayer:
        """The layer of a call's arguments (the forward's or the backward's): its input is (steps, batch, features)
        whatever ``batch_first`` says, as ``mkldnn_rnn`` transposes it first; the hidden size is the width of the
        hidden-to-hidden weight, the third argument."""
        steps, batch, inputs = args[0].shape
        size = args[0].element_size()
        hidden = args[2].shape[-1]
        return cls(steps, batch, inputs, hidden, size, brgemm=size == 2 and cpu_isa in _BRGEMM_ISAS)

    def workspace(self) -> int:
        """The bytes of the workspace the forward returns and the backward reads (``set_workspace_sizes``)."""
        n, h, s = self.batch, self.hidden, self.size
        states = 2 * (self.steps + 1) * n  # the layer's input and output rows, for each step and the one before
        wide = max(self.inputs, h)
        parts = (
            self.steps * n * _good_ld(_GATES * h, s) * s,  # the gates of every step
            self.steps * n * _good_ld(h, s) * s,  # the hidden states
            states * _good_ld(wide, s) * s,  # the states (the iteration's share the layer's buffer)
            states * h * s,  # the cell states
            states * _good_ld(wide, _FP32) * _FP32,  # the states' gradients, for the layer and the iteration
            states * _good_ld(wide, _FP32) * _FP32,
            states * h * _FP32,  # the cell states' gradients
        )
        return sum(_pages(part) for part in parts)

    def forward_working(self) -> list[int]:
        """The buffers the forward holds while it runs: the summed biases, the weights in oneDNN's layout, and
        its scratchpad (the reference kernels' keeps every step's gates where the batch is under 128)."""
        n, h, s = self.batch, self.hidden, self.size
        if self.brgemm:
            weights = [_GATES * _round_up(h, _BRGEMM_BLOCK) * _round_up(k, 2) * s for k in (self.inputs, h)]
            rows = n
        else:
            weights = [k * _good_ld(_GATES * h, s) * s for k in (self.inputs, h)]
            rows = self.steps * n if n < _MERGED_BATCH else n
        gates = _pages(rows * _good_ld(_GATES * h, _FP32) * _FP32)
        return [_GATES * h * s, *weights, gates + self._scratch_states() + _BOOKED]

    def backward_working(self) -> list[int]:
        """The buffers oneDNN's backward holds while it runs, beside the gradients it returns: the biases summed,
        fp32 copies of bf16 gradients, the weights and their gradients in its layouts, and its scratchpad."""
        n, h, s = self.batch, self.hidden, self.size
        fp32_copies = [] if s == _FP32 else [self.steps * n * h * _FP32, n * h * _FP32, n * h * _FP32]
        if self.brgemm:
            weights = [_round_up(k, _BRGEMM_BLOCK) * _GATES * _round_up(h, 2) * s for k in (self.inputs, h)]
            gates = _pages(n * _good_ld(_GATES * h, s) * s)
            blocks = n * (self.inputs + h + 64) * s + 896  # fitted: rows of inputs and more (within 1.5 KiB)
        else:  # reordered only where oneDNN pads the rows
            weights = [_GATES * h * _good_ld(k, s) * s for k in (self.inputs, h) if _good_ld(k, s) != k]
            gates = _pages(self.steps * n * _good_ld(_GATES * h, s) * s)
            blocks = 0
        weight_grads = [k * _good_ld(_GATES * h, _FP32) * _FP32 for k in (self.inputs, h)] + [_GATES * h * _FP32]
        scratch = gates + self._scratch_states() + _BOOKED + blocks
        return [_GATES * h * s, *fp32_copies, *weights, *weight_grads, scratch]

    def _scratch_states(self) -> int:
        """A step's hidden state and its gradient, as the scratchpad keeps them."""
        n, h, s = self.batch, self.hidden, self.size
        return _pages(n * _good_ld(h, s) * s) + _pages(n * _good_ld(h, _FP32) * _FP32)


def lstm_forward(args: Any, out: tuple[torch.Tensor, ...], cpu_isa: CpuIsa) -> tuple[torch.Tensor, ...]:
    """``mkldnn_rnn_layer``'s outputs with the workspace it returns in training at its size, after holding the
    buffers the call works in. Without gradients the kernel keeps no workspace, and the outputs stand."""
    if not torch.is_grad_enabled():
        return out
    layer = LstmLayer.of(args, cpu_isa)
    workspace = torch.empty(layer.workspace(), dtype=torch.uint8)
    working = [torch.empty(size, dtype=torch.uint8) for size in layer.forward_working()]
    del working  # freed as the kernel returns
    return (*out[:3], workspace)


def lstm_backward(args: Any, out: tuple[torch.Tensor, ...], cpu_isa: CpuIsa) -> tuple[torch.Tensor, ...]:
    """``mkldnn_rnn_layer_backward``'s outputs, after holding what the call works in: a gradient of the output, the
    last hidden state or cell state that autograd leaves undefined is filled with zeros, one that is not contiguous
    is copied. The second bias gradient is a copy of the first, where the meta kernel returns the same tensor."""
    layer = LstmLayer.of(args, cpu_isa)
    grads = [(args[10], (layer.steps, layer.batch, layer.hidden)), (args[11], args[5].shape), (args[12], args[6].shape)]
    filled = [
        torch.empty(shape, dtype=args[0].dtype) if grad is None else torch.empty(grad.shape, dtype=grad.dtype)
        for grad, shape in grads
        if grad is None or not grad.is_contiguous()
    ]
    working = [torch.empty(size, dtype=torch.uint8) for size in layer.backward_working()]
    del working, filled
    return (*out[:4], torch.empty_like(out[3]), *out[5:])
