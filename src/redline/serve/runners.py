"""How one padded batch runs: the model's forward as called per bucket, eagerly or as a replayed CUDA graph.

    forward = make_forward(model, Setting("bf16-mixed", compiled=False), device)
    runner = GraphRunner(forward, device) if graphs else EagerRunner(forward, device)
    runner.prepare(bucket)                     # eager: one call on zeros; graphs: warm up, then capture
    outputs = runner.run(inputs, bucket)       # inputs: <= bucket rows on the CPU; outputs: those rows, on the CPU

A ``-true`` precision runs on weights cast once (``convert``, in place; ``variant_of`` converts a
copy), its floating inputs cast to match, where autocast (``-mixed``) casts the weights on every
call; channels_last runs on weights and 4-d inputs laid out NHWC. A forward may be compiled
(``compile_module`` patches the model's forward in place): the runners only call it. With CUDA
graphs, a compiled forward is compiled in plain mode (not "reduce-overhead", whose own CUDA graphs
would nest in ours) during the warm-up calls, then its kernels are captured like any others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from redline.errors import ServableError, describe_error, few
from redline.plan.inference import Setting, autocast_of
from redline.runtime.cuda_errors import is_sticky_cuda_error
from redline.runtime.precision import Precision
from redline.runtime.trial import copy_model

Forward = Callable[[torch.Tensor], torch.Tensor]

# Calls on a side stream before a capture: lazy initialisation (cuBLAS handles, cuDNN plans, a
# compile) must happen outside the graph (https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs).
CAPTURE_WARMUP_CALLS = 3
MOST_SAID = 4  # values of a tuple or dict a model returned, named in the error


class CaptureFailed(RuntimeError):
    """The forward ran but could not be captured as a CUDA graph (it synchronises with the CPU, say)."""

    def without_graphs(self) -> str:
        """The reason CUDA graphs were turned off."""
        return f"capture failed, running without graphs: {describe_error(self)}"


WEIGHT_DTYPES = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}  # the precisions that cast the weights


def make_forward(model: nn.Module, setting: Setting, device: torch.device) -> Forward:
    """Return the model's call under inference_mode and ``setting``'s autocast (both per thread), its inputs cast
    and laid out as ``setting`` has the weights (``model`` already converted for it)."""
    precision = Precision(autocast_of(setting.precision), device)
    dtype = WEIGHT_DTYPES.get(setting.precision)
    layout = setting.channels_last

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), precision.autocast():
            if dtype is not None and inputs.is_floating_point():
                inputs = inputs.to(dtype)
            if layout and inputs.ndim == 4:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            outputs: torch.Tensor = model(inputs)
        return outputs

    return forward


def convert(model: nn.Module, setting: Setting) -> nn.Module:
    """Cast ``model``'s floating weights and buffers for ``setting``'s precision, and lay them out, in place."""
    dtype = WEIGHT_DTYPES.get(setting.precision)
    if dtype is not None:
        model.to(dtype)
    if setting.channels_last:
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model


def variant_of(model: nn.Module, setting: Setting) -> nn.Module:
    """A copy of ``model`` converted for ``setting``: what the engine times a setting on whose weights differ."""
    return convert(copy_model(model), setting)


def weight_bytes(model: nn.Module, setting: Setting) -> int:
    """The bytes of ``model``'s weights and buffers converted for ``setting`` (floating ones cast where it casts)."""
    cast = WEIGHT_DTYPES.get(setting.precision)
    size = torch.empty((), dtype=cast).element_size() if cast is not None else 0
    tensors = (*model.parameters(), *model.buffers())
    return sum(t.numel() * (size if size and t.is_floating_point() else t.element_size()) for t in tensors)


def pad_to(inputs: torch.Tensor, bucket: int) -> torch.Tensor:
    """Return ``inputs`` with zero rows appended up to ``bucket`` rows (``inputs`` itself when it has them)."""
    missing = bucket - inputs.shape[0]
    if missing < 0:
        raise ValueError(f"{inputs.shape[0]} rows do not fit a bucket of {bucket}")
    if missing == 0:
        return inputs
    return torch.cat([inputs, inputs.new_zeros((missing, *inputs.shape[1:]))])


def check_outputs(outputs: Any, bucket: int) -> torch.Tensor:
    """Return ``outputs`` if they are one tensor of ``bucket`` rows; else a ServableError naming what they are."""
    if not isinstance(outputs, torch.Tensor):
        raise ServableError(
            f"the model returned {_described(outputs)}; the engine serves models that return one tensor\n"
            f"hint: {_one_tensor_hint(outputs)}"
        )
    if outputs.ndim == 0 or outputs.shape[0] != bucket:
        raise ServableError(
            f"the model returned shape {tuple(outputs.shape)} for a batch of {bucket}; the engine serves models "
            "whose outputs have one row per input row (batch first)"
        )
    return outputs


def _described(outputs: Any) -> str:
    """What a model returned, in short: ``a tuple of 2 values: tensor (4, 2), tensor (4, 3)``, ``a dict with keys
    'logits' (tensor (4, 2))``; a dict's subclasses (a transformers ModelOutput) by their own name."""
    kind = type(outputs).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    if isinstance(outputs, Mapping) and outputs:
        keys = [f"{key!r} ({_item(value)})" for key, value in outputs.items()]
        return f"{article} {kind} with keys {few(keys, MOST_SAID)}"
    if isinstance(outputs, tuple | list) and outputs:
        values = [_item(value) for value in outputs]
        return f"{article} {kind} of {len(outputs)} values: {few(values, MOST_SAID)}"
    if isinstance(outputs, Mapping | tuple | list):
        return f"an empty {kind}"
    return kind


def _item(value: Any) -> str:
    return f"tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _one_tensor_hint(outputs: Any) -> str:
    """How to serve a model whose forward returns several values: wrap it, returning the one meant."""
    if isinstance(outputs, Mapping) and outputs:
        pick = f"[{next(iter(outputs))!r}]"
    elif isinstance(outputs, tuple | list) and outputs:
        pick = "[0]"
    else:
        return "have the model's forward return the batch's outputs as one tensor, one row per input row"
    return (
        f"serve a module whose forward returns the one tensor meant: a wrapper whose forward(x) returns "
        f"self.model(x){pick}"
    )


def copy_out(outputs: Any, rows: int, bucket: int) -> torch.Tensor:
    """Return the first ``rows`` outputs of a ``bucket``-row batch as a CPU tensor of their own, floats as float32.

    The copy is taken before anything else runs: a CUDA graph's next replay overwrites its outputs.
    """
    kept = check_outputs(outputs, bucket)[:rows]
    if kept.is_floating_point():
        kept = kept.float()
    return kept.to("cpu", copy=True)


class EagerRunner:
    """Each batch padded, moved to the device and run through the forward."""

    graphs = False

    def __init__(self, forward: Forward, device: torch.device) -> None:
        self.forward = forward
        self.device = device

    def prepare(self, bucket: int, sample: torch.Tensor) -> None:
        """Run the bucket once on ``sample`` (a zero batch of its size): the first call's costs are paid here."""
        self.run(sample, bucket)

    def run(self, inputs: torch.Tensor, bucket: int) -> torch.Tensor:
        """Return the outputs of ``inputs`` (at most ``bucket`` rows), padded to ``bucket`` on the way."""
        padded = pad_to(inputs, bucket).to(self.device, non_blocking=True)
        return copy_out(self.forward(padded), inputs.shape[0], bucket)


class GraphRunner:
    """One captured CUDA graph per bucket, replayed on a static input buffer.

    Captures share one memory pool: safe because graphs never run concurrently (the engine holds a
    lock) and each replay's outputs are copied out before the next replay, so a graph's scratch
    memory overlapping another's outputs is never read stale. Capture the largest bucket first so
    the smaller ones fit in what it reserved.

    Everything runs with the engine's device current (the model's thread starts on device 0, and
    ``torch.cuda.graph`` captures on the current device's stream), and captures on a stream of the
    runner's own on that device: a model on ``cuda:1`` is captured there, not as an empty graph on 0.
    """

    graphs = True

    def __init__(self, forward: Forward, device: torch.device) -> None:
        self.forward = forward
        self.device = device
        with torch.cuda.device(device):
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def prepare(self, bucket: int, sample: torch.Tensor) -> None:
        """Warm the forward up on a side stream, then capture it on a static buffer shaped like ``sample``."""
        with torch.cuda.device(self.device):
            static_in = sample.to(self.device, copy=True)
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for _ in range(CAPTURE_WARMUP_CALLS):
                    self.forward(static_in)
            current.wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    static_out = self.forward(static_in)
            except Exception as exc:
                torch.cuda.set_stream(current)  # a failed capture's exit does not put the stream back
                if is_sticky_cuda_error(exc):
                    raise
                raise CaptureFailed(f"bucket {bucket}: {describe_error(exc)}") from exc
        # Checked now, as the eager runner's first call checks them: outputs no request can be given (a tuple,
        # another row count) fail the warm-up, not every request after a warm-up that said ready.
        self.captured[bucket] = (graph, static_in, check_outputs(static_out, bucket))

    def run(self, inputs: torch.Tensor, bucket: int) -> torch.Tensor:
        """Copy ``inputs`` into the bucket's buffer (zeros after them), replay its graph, copy the outputs out."""
        if bucket not in self.captured:
            self.prepare(bucket, torch.zeros((bucket, *inputs.shape[1:]), dtype=inputs.dtype))
        graph, static_in, static_out = self.captured[bucket]
        rows = inputs.shape[0]
        with torch.cuda.device(self.device):
            static_in[:rows].copy_(inputs)
            static_in[rows:].zero_()
            graph.replay()
            return copy_out(static_out, rows, bucket)  # the copy to the CPU waits for the replay
