"""Timing the spans of a run's work on its device: marks taken as the work is queued, read once it has run.

The run's first steps time its forms (runtime/compile_check.py) over the steps' own work alone: from a step's first
training forward to its optimizer step. Whatever the loop does between two steps (an evaluation, a log line, a
checkpoint, the loader's next batch) is the same in every form, and a block of steps that took one in would be
held against blocks that did not. On a CPU a mark is the clock's reading. On CUDA the work is queued, so a mark
is an event recorded on the device's stream: the device stamps it when it reaches it, after the work queued before,
and the seconds between two such stamps are the device's time for what was queued between them. The device is waited
for (``wait``) before any span is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from redline.runtime.weak_hook import WeakHook


@dataclass
class Stopwatch:
    """Marks points of the run's work (``mark``) and gives the seconds between two of them (``seconds``), after
    ``wait``. ``clock`` reads seconds where no device stamps its work: a test gives a fake one."""

    clock: Callable[[], float] = time.perf_counter
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def mark(self) -> Any:
        """A point of the work queued so far: the clock's reading, or a CUDA event on the device's current stream."""
        if self.device.type != "cuda":
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self) -> None:
        """Wait for the device's queued work: the marks before are stamped from then on."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from mark ``start`` to mark ``end`` (both taken before the last ``wait``)."""
        if self.device.type != "cuda":
            return float(end - start)
        return float(start.elapsed_time(end)) / 1e3


@dataclass
class StepTimer:
    """The spans of a run's steps, each from its first training forward to the end of its optimizer step.

    ``watch`` hooks a model: its first training forward after a step begins the next step's span. A training forward
    is one with autograd on: a loop may train in eval mode (BatchNorm statistics and dropout frozen), and an
    evaluation without autograd begins no span; one in eval mode with autograd on begins it only until a forward in
    training mode comes before the step (the loop's evaluation between two training-mode steps). ``stepped`` ends a
    span; a step whose forward no watched model ran (the loop called another module) is timed from the end of the
    step before. ``block`` adds up the spans ended since it was last called.
    """

    stopwatch: Stopwatch = field(default_factory=Stopwatch)
    _spans: list[tuple[Any, Any]] = field(default_factory=list)
    _begun: Any = None  # the mark of the first training forward since the last step, if a watched model ran one
    _begun_training: bool = False  # that forward ran in training mode: no later one begins the span again
    _stepped: Any = None  # the mark of the last step's end
    _hooks: dict[int, RemovableHandle] = field(default_factory=dict)  # each watched model's, by its id

    def watch(self, model: nn.Module) -> None:
        """Begin each step's span at ``model``'s first training forward, until ``unwatch``."""
        if id(model) not in self._hooks:  # held weakly: a copy of the model made meanwhile copies no timer
            self._hooks[id(model)] = model.register_forward_pre_hook(WeakHook(self, "_forward"), prepend=True)

    def unwatch(self) -> None:
        """Let go of the watched models: they keep no hook of the timer."""
        for hook in self._hooks.values():
            hook.remove()
        self._hooks = {}

    def _forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and (self._begun is None or (module.training and not self._begun_training)):
            self._begun, self._begun_training = self.stopwatch.mark(), module.training

    def stepped(self) -> None:
        """End the span of the step just taken."""
        end = self.stopwatch.mark()
        start = self._begun if self._begun is not None else self._stepped
        if start is not None:
            self._spans.append((start, end))
        self._begun, self._begun_training, self._stepped = None, False, end

    def block(self) -> float:
        """The seconds of the spans ended since the last call, added up (once the device has run them)."""
        spans, self._spans = self._spans, []
        if not spans:
            return 0.0
        self.stopwatch.wait()
        return sum(self.stopwatch.seconds(start, end) for start, end in spans)
