"""The InferenceEngine: a model made ready for inference, fed batches padded up to fixed sizes.

    engine = InferenceEngine(servable, max_batch_size=32)
    engine.warm_up()                           # every bucket once; ``engine.ready`` after
    outputs = engine.predict(batch)            # a CPU tensor, one row per input row

The model runs in eval mode under inference_mode and the Plan's autocast. Batches are padded up to
the next bucket (powers of two up to ``max_batch_size`` by default), so a compiled model or a CUDA
graph sees a few fixed shapes only; a batch larger than ``max_batch_size`` runs in chunks.
Everything runs in the thread that calls ``predict``: autocast and inference_mode are per thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from redline.config import positive_int
from redline.errors import invalid
from redline.hardware.device import probe_accelerators, probe_device
from redline.plan import Choice
from redline.plan.device import resolve_device
from redline.plan.precision import resolve_precision
from redline.runtime.precision import Precision
from redline.serve.servable import Servable


def bucket_sizes(max_batch_size: int, requested: Sequence[int] | str = "auto") -> tuple[int, ...]:
    """Return the padded batch sizes: powers of two below ``max_batch_size``, and it; or those given."""
    positive_int("max_batch_size", max_batch_size)
    if requested == "auto":
        powers = [1 << k for k in range(max_batch_size.bit_length()) if 1 << k < max_batch_size]
        return (*powers, max_batch_size)
    if isinstance(requested, str) or not requested:
        raise invalid("batch_buckets", requested, "'auto' or batch sizes", "e.g. batch_buckets=(1, 8, 32)")
    sizes: list[int] = sorted(set(requested))
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes) or sizes[-1] != max_batch_size:
        raise invalid(
            "batch_buckets", requested, f"positive sizes, the largest equal to max_batch_size={max_batch_size}"
        )
    return tuple(sizes)


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """Return the smallest bucket that holds ``size`` samples (``size`` at most the largest bucket)."""
    return next(b for b in buckets if b >= size)


class InferenceEngine:
    """A model ready for inference on one device: ``warm_up()`` once, then ``predict(batch)`` from one thread."""

    def __init__(
        self,
        servable: Servable,
        *,
        device: str = "auto",
        precision: str = "auto",
        compile: str = "auto",
        max_batch_size: int = 32,
        batch_buckets: Sequence[int] | str = "auto",
    ) -> None:
        if not isinstance(servable, Servable):
            raise invalid(
                "servable", type(servable).__name__, "a redline.Servable", "Servable(model=m, input_shape=(...))"
            )
        self.servable = servable
        self.max_batch_size = max_batch_size
        self.buckets = bucket_sizes(max_batch_size, batch_buckets)
        chosen_device = resolve_device(device, probe_accelerators())
        self.device = torch.device(chosen_device.value)
        facts = probe_device(self.device)
        chosen_precision = resolve_precision(precision, facts)
        self.precision = Precision(chosen_precision.value, self.device)
        self.plan: dict[str, Choice[Any]] = {
            "device": chosen_device,
            "precision": chosen_precision,
            "compile": Choice(False, "not implemented yet: eager"),
            "buckets": Choice(self.buckets, "powers of two up to max_batch_size"),
        }
        self.model = servable.model.to(self.device).eval()
        self.ready = False
        self.broken: str | None = None  # set when an error left the device unusable (a sticky CUDA error)
        self._lock = threading.Lock()

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape."""
        return self.servable.input_shape

    def warm_up(self) -> None:
        """Run every bucket once on zeros, so the first requests pay no first-call cost; then ``ready``."""
        for size in self.buckets:
            self.predict(torch.zeros((size, *self.input_shape), dtype=self.servable.torch_dtype))
        self.ready = True

    def predict(self, batch: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Return the model's outputs for ``batch`` (samples along the first dimension) as a CPU tensor."""
        inputs = torch.as_tensor(batch)
        if inputs.ndim != len(self.input_shape) + 1 or tuple(inputs.shape[1:]) != self.input_shape:
            raise invalid("batch", f"shape {tuple(inputs.shape)}", f"(N, {', '.join(map(str, self.input_shape))})")
        chunks = [self._run(part) for part in inputs.split(self.max_batch_size)]
        return torch.cat(chunks) if len(chunks) > 1 else chunks[0]

    def _run(self, inputs: torch.Tensor) -> torch.Tensor:
        size = inputs.shape[0]
        bucket = bucket_for(size, self.buckets)
        if bucket > size:
            pad = inputs.new_zeros((bucket - size, *inputs.shape[1:]))
            inputs = torch.cat([inputs, pad])
        with self._lock, torch.inference_mode(), self.precision.autocast():
            outputs = self.model(inputs.to(self.device, non_blocking=True))
        outputs = outputs[:size]
        if outputs.is_floating_point():
            outputs = outputs.float()
        return outputs.cpu()
