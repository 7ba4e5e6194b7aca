"""Throughput and MFU of a training run, measured without a device sync per step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from redline.hardware.catalog import GPUSpec, find_gpu, mig_parent, peak_tflops
from redline.hardware.flops import count_train_flops, matmul_precision, mfu, share_of_peak, weights_dtype
from redline.hardware.memory import WindowPeak
from redline.runtime.cache import best_matmul_peak
from redline.runtime.runtime import Runtime
from redline.runtime.samples import count_batch
from redline.task import Task


@dataclass(frozen=True)
class Figures:
    """A run's throughput after its first step, and its model FLOPs utilisation."""

    samples_per_s: float | None  # None until a step after the first has run
    tokens_per_s: float | None
    flops_per_step: int | None
    mfu: float | None  # achieved FLOP/s over the datasheet's dense peak; None on a CPU or unknown GPU
    peak_tflops: float | None
    measured_peak_ratio: float | None  # achieved FLOP/s over a matmul measured on this device
    mfu_note: str | None = None  # why ``mfu`` is None, as the summary says it


UNTIMED = "no step after the first, which warms up and is not timed"  # why a run of one step has no rates
UNTRAINED = "no step trained in this stretch"  # a resumed run with none left to train (it writes its results)
NOT_COUNTED = "the step's FLOPs could not be counted"  # in the note of a run without MFU, where that is why


class Throughput:
    """Count FLOPs once, time the steps from after the first, and report per window and in total.

    Evaluation, checkpoints and the callbacks' hooks run inside ``excluded(kind)``: their time is
    counted apart (``seconds``) and left out of the rates, which so cover training steps only. So is a compile
    inside a training step after the first (an automatic compile's check compiles at its switch,
    runtime/compile_check.py; a recompile), which the summary reports as ``compile_seconds``.
    """

    def __init__(
        self, rt: Runtime, task: Task, *, world_size: int = 1, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.rt = rt
        self.task = task
        self.world_size = world_size  # every rank runs an equal share: global figures are world x local
        self.clock = clock
        self.flops_per_step: int | None = None
        self._flops_per_sample: float | None = None
        self.start: float | None = None
        self.steps = self.samples = 0
        self.tokens: int | torch.Tensor = 0  # on the device, read where the figures are (after a sync)
        self.seconds: dict[str, float] = {"eval": 0.0, "checkpoint": 0.0, "callbacks": 0.0}
        self._paused = 0.0  # excluded time since ``start``
        self._compiled = 0.0  # the Runtime's training compile seconds at ``start``
        self._window_from = (0.0, 0, 0, 0)  # timed seconds, steps, samples and tokens at the log window's start
        self._memory = WindowPeak(rt.device)  # the first window starts here
        self._model: nn.Module | None = None  # the trained model, whose parameters' dtype the matmuls may run in

    @contextlib.contextmanager
    def excluded(self, kind: str) -> Iterator[None]:
        """Time what runs inside as ``kind`` ("eval", "checkpoint", "callbacks"), apart from the steps' time.

        The device is synchronised first, so the steps queued before are not counted as ``kind``.
        """
        self._sync()
        begin = self.clock()
        try:
            yield
        finally:
            spent = self.clock() - begin
            self.seconds[kind] = self.seconds.get(kind, 0.0) + spent
            if self.start is not None:
                self._paused += spent

    @property
    def excluded_s(self) -> float:
        """Seconds spent so far inside ``excluded`` (evaluation, checkpoints, callbacks), of every kind."""
        return sum(self.seconds.values())

    def count(self, samples: int, tokens: int | torch.Tensor | None) -> None:
        """Count one micro-batch of this rank's (``tokens``: None where its targets are not token ids); the warm-up
        step's are left out."""
        if self.start is not None:
            self.samples += samples
            self.tokens = self.tokens + tokens if tokens is not None else self.tokens

    def first_step_done(self, inputs: Any, targets: Any, model: nn.Module) -> None:
        """Mark the end of the warm-up step and count one step's FLOPs; later calls count the steps."""
        if self.start is not None:
            self.steps += 1
            return
        self._model = model
        flops = count_train_flops(model, self.task.loss_fn, (inputs, targets))
        self.flops_per_step = flops * self.rt.options.grad_accum * self.world_size if flops is not None else None
        # the FLOPs of a sample: a first batch may be an epoch's short last one (a resume)
        rows = count_batch(inputs, targets)
        self._flops_per_sample = flops / rows if flops is not None and rows else None
        self._sync()
        self.start = self.clock()
        self._compiled = self.rt.training_compile_seconds

    def timed_s(self) -> float:
        """Seconds the timed steps took so far: from the first step's end, less excluded time and later compiles."""
        if self.start is None:
            return 0.0
        compiling = self.rt.training_compile_seconds - self._compiled
        return self.clock() - self.start - self._paused - compiling

    def window(self) -> dict[str, float | None]:
        """Return the logged figures of the steps since the last call (a log window), timed as ``totals`` times them:
        the first step, excluded time and compiles left out, so the rows and the summary agree. The figures are None
        for a window that holds no timed step (the first step alone). Call it after a device sync."""
        now = (self.timed_s(), self.steps, self.samples, int(self.tokens))
        elapsed_s, steps, samples, tokens = (end - begin for begin, end in zip(self._window_from, now, strict=True))
        self._window_from = now
        timed = steps > 0 and elapsed_s > 0
        samples, tokens = samples * self.world_size, tokens * self.world_size
        return {
            "samples_per_s": samples / elapsed_s if timed else None,
            "tokens_per_s": tokens / elapsed_s if timed and tokens else None,
            "step_time_ms": 1e3 * elapsed_s / steps if timed else None,
            "mem_gib": self.memory_gib(),
        }

    def memory_gib(self) -> float | None:
        """Peak memory since the last call (the log window): allocated on a GPU, resident on a CPU.

        ``hardware.memory.WindowPeak`` says what each device gives: on a CPU where the kernel's
        high-water mark cannot be reset it is the run's peak so far, and on MPS the memory at the read.
        """
        peak = self._memory.read()
        return peak / 2**30 if peak is not None else None

    def totals(self) -> Figures:
        """Return the run's figures from after its first step (syncs once)."""
        self._sync()
        elapsed = self.timed_s()
        if not self.steps or elapsed <= 0:
            untimed = UNTRAINED if self.start is None else UNTIMED
            return Figures(None, None, self.flops_per_step, None, None, None, mfu_note=untimed)
        # Per device: the MFU of one device equals the job's when every rank runs an equal share. The FLOPs are the
        # samples the timed steps ran, so a short batch counted first, or short batches timed, weigh what they ran.
        flops = self._flops_per_sample * self.samples if self._flops_per_sample and self.samples else None
        if flops is not None:
            self.flops_per_step = round(flops * self.world_size / self.steps)  # the mean step's, every rank's
        achieved = flops / elapsed if flops is not None else None
        plan = self.rt.explain()
        spec = find_gpu(self.rt.facts.name) if self.rt.device.type == "cuda" else None
        precision = self._matmul_precision()  # a bfloat16 model trained in fp32 runs at the bf16 peak
        peak = peak_tflops(spec, precision, tf32=plan.tf32.value) if spec and precision else None
        measured = None
        if achieved is not None and precision is not None:
            device, facts = self.rt.device, self.rt.facts
            measured = share_of_peak(achieved, best_matmul_peak(device, facts, precision))
            if measured is None:  # stalled, or the GPU is full: once more, over more blocks
                measured = share_of_peak(achieved, best_matmul_peak(device, facts, precision, blocks=20))
        return Figures(
            samples_per_s=self.samples * self.world_size / elapsed,
            tokens_per_s=tokens * self.world_size / elapsed if (tokens := int(self.tokens)) else None,
            flops_per_step=self.flops_per_step,
            mfu=mfu(achieved, peak) if achieved is not None else None,
            peak_tflops=peak,
            measured_peak_ratio=measured,
            mfu_note=None if peak is not None and achieved is not None else self._no_mfu(spec),
        )

    def _matmul_precision(self) -> str | None:
        """The precision whose peak the run's matmuls run at (``matmul_precision``); the run's own before a step."""
        name = self.rt.precision.name
        return name if self._model is None else matmul_precision(name, self._model)

    def _no_mfu(self, spec: GPUSpec | None) -> str:
        """Why the run has no MFU: no datasheet peak for its device and precision, or no FLOPs counted."""
        device, precision = self.rt.device.type, self._matmul_precision()
        if self._model is not None and self._flops_per_sample is None:  # counted on the first step, and failed there
            return (
                f"{NOT_COUNTED}: they are counted on meta tensors, where this step does not run (a .item() or "
                "another branch on the data's values)"
            )
        if device != "cuda":
            return f"no datasheet peak for {'a CPU' if device == 'cpu' else device.upper()}"
        if precision is None and self._model is not None:
            dtype = str(weights_dtype(self._model)).removeprefix("torch.")
            return f"the model holds {dtype} parameters, and no datasheet gives a {dtype} matmul peak"
        if spec is None and (card := mig_parent(self.rt.facts.name)) is not None:
            return f"{self.rt.facts.name} is a MIG slice of an {card.name}, whose share of the card's peak is unknown"
        if spec is None:
            return f"unknown GPU: {self.rt.facts.name}"
        return f"no datasheet peak for {precision} on {spec.name}"

    def _sync(self) -> None:
        if self.rt.device.type == "cuda":
            torch.cuda.synchronize(self.rt.device)
