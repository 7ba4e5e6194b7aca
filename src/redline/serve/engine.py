"""The InferenceEngine: a model made ready for inference, fed batches padded up to fixed sizes.

    engine = InferenceEngine(model, input_shape=(1, 8, 8))   # or InferenceEngine(servable)
    engine.warm_up()                           # every bucket once (compiled, captured); ``engine.ready`` after
    outputs = engine.predict(batch)            # a CPU tensor, one row per input row
    engine.plan_dict()                         # every choice with its reason, as JSON-ready data

The model runs in eval mode under inference_mode and the Plan's precision: autocast (``-mixed``), or
weights cast once (``-true``); channels_last lays out a convolutional model NHWC. The engine takes
the model over: it moves it to the device and converts it, in place, to the precision and layout
kept. Batches are padded up to the next bucket (powers of two up to ``max_batch_size`` by default),
so a compiled model or a CUDA graph sees a few fixed shapes only; a batch larger than
``max_batch_size`` runs in chunks. With ``measure="auto"`` the precision, layout and compile
candidates a rule cannot rank are timed on the largest and smallest buckets when the engine is
built (serve/measure.py), and cached on disk. Where one setting wins on the largest bucket and
another on the smallest, both serve: the buckets between are timed both ways, and the smallest
buckets run the other (the plan's ``small_batches``), on a second copy of the model where their weights differ.
A sticky CUDA error (an illegal memory access, a device-side assert) marks the engine ``broken``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from redline.config import positive_int
from redline.errors import DeviceUnavailableError, describe_error
from redline.hardware.contention import Stalls
from redline.hardware.device import probe_device
from redline.hardware.memory import host_memory_bytes
from redline.plan import Choice
from redline.plan.inference import (
    Proposal,
    Setting,
    Timing,
    choose,
    no_room_for_copy,
    propose,
    read_measure,
    resolve_cuda_graphs,
    short_job,
    split_buckets,
)
from redline.plan.layout import has_conv2d
from redline.runtime.compile import (
    CompileRecord,
    compile_module,
    compile_supported,
    explain_compile,
    recompile_room,
)
from redline.runtime.compiler_facts import is_compiler_error
from redline.runtime.cuda_errors import is_sticky_cuda_error
from redline.runtime.oom import is_oom
from redline.serve.batcher import bucket_for, bucket_sizes
from redline.serve.inputs import as_batch, model_inputs
from redline.serve.measure import (
    load_measured,
    measure_key,
    store_capture_failure,
    store_unless_busy,
    time_settings,
    weights_digest,
)
from redline.serve.options import DEFAULT_MAX_BATCH, engine_device
from redline.serve.runners import (
    CaptureFailed,
    EagerRunner,
    Forward,
    GraphRunner,
    convert,
    make_forward,
    variant_of,
    weight_bytes,
)
from redline.serve.servable import Servable, as_servable
from redline.task import model_fingerprint

log = logging.getLogger("redline")

PROBE_SEED = 0  # the random batch on which each candidate's outputs are compared with the reference's


class WarmUpStopped(Exception):
    """``warm_up(stop)`` ended early because ``stop`` was set: the engine is not ready, and nothing went wrong."""


class InferenceEngine:
    """A model ready for inference on one device: ``warm_up()`` once, then ``predict(batch)`` from one thread."""

    def __init__(
        self,
        model: Servable | nn.Module,
        *,
        input_shape: Sequence[int] | None = None,
        input_dtype: str | None = None,
        device: str = "auto",
        precision: str = "auto",
        compile: str | bool = "auto",
        cuda_graphs: str | bool = "auto",
        measure: str | bool = "auto",
        channels_last: str | bool = "auto",
        max_batch_size: int = DEFAULT_MAX_BATCH,
        batch_buckets: Sequence[int] | str = "auto",
        planned_batches: int | None = None,
    ) -> None:
        self.servable = as_servable(model, input_shape, input_dtype)
        self.max_batch_size = max_batch_size
        positive_int("planned_batches", planned_batches, optional=True)
        self.planned_batches = planned_batches  # the job's length where one is known (predict's), for the compile
        self.buckets = bucket_sizes(max_batch_size, batch_buckets)
        chosen_device = engine_device(device)
        self.device = torch.device(chosen_device.value)
        self.facts = probe_device(self.device)
        proposal = propose(
            self.facts, precision=precision, compile=compile, measure=read_measure(measure),
            compile_supported=lambda: compile_supported(self.facts.type), channels_last=channels_last,
            convolutional=has_conv2d(self.servable.model),
        )  # fmt: skip
        powers = "powers of two up to max_batch_size"
        if max_batch_size & (max_batch_size - 1):  # no power of two: the largest bucket is max_batch_size itself
            powers = f"powers of two below max_batch_size, and {max_batch_size}"
        shown = powers if batch_buckets == "auto" else "requested"
        self.plan: dict[str, Choice[Any]] = {
            "device": chosen_device,
            "precision": proposal.precision,
            "compile": proposal.compile,
            "channels_last": proposal.channels_last,
            "cuda_graphs": resolve_cuda_graphs(cuda_graphs, self.facts),
            "buckets": Choice(self.buckets, f"{shown}; a batch is padded up to the next bucket"),
        }
        self.model = convert(self.servable.model.to(self.device).eval(), proposal.reference)
        # Taken before anything runs: a model's counters (``self.calls += 1`` in forward) are hashed as its settings.
        self._identity = f"{model_fingerprint(self.model)}:{weights_digest(self.model)}"
        self._kept = proposal.reference  # the setting the model is converted for
        self._variants: dict[tuple[str, bool], nn.Module] = {}  # copies other settings are timed (or run) on
        self._split: tuple[Setting, frozenset[int]] | None = None  # another setting for these (small) buckets
        self._eager_split: tuple[tuple[Setting, frozenset[int]], Choice[Any]] | None = None  # split before a compile
        self.ready = False
        self.broken: str | None = None  # set when an error left the device unusable (a sticky CUDA error)
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None  # set while warming up: asked to stop between buckets
        self._record: CompileRecord | None = None
        self._own_forward = "forward" in vars(self.model)  # a forward set on the instance, put back on uncompile
        if proposal.candidates:
            self._guarded(lambda: self._measure(proposal))
        elif proposal.compile_after:  # precision and layout given: nothing else is timed, nor is the compile
            self.plan["compile"] = Choice(False, "auto: eager; a compile is timed beside the other candidates only")
        self._set_up()

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape."""
        return self.servable.input_shape

    def plan_dict(self) -> dict[str, dict[str, Any]]:
        """Return the plan as JSON-ready data: ``{axis: {"value": ..., "reason": ...}}``."""
        out = {}
        for axis, choice in self.plan.items():
            value = list(choice.value) if isinstance(choice.value, tuple) else choice.value
            out[axis] = {"value": value, "reason": choice.reason}
        return out

    def warm_up(self, stop: threading.Event | None = None) -> None:
        """Run every bucket once on zeros (compiling and capturing it), so no request pays a first-call cost.

        ``stop`` set (a server shutting down) ends the warm-up before the next bucket with WarmUpStopped.
        """
        with self._lock:
            self._stop = stop
            try:
                self._guarded(self._warm_buckets)
            finally:
                self._stop = None
            if self._record is not None:  # the compiles counted so far, or the fall back to eager
                self.plan["compile"] = explain_compile(self._planned_compile, [self._record])
            self.ready = True

    def predict(self, batch: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Return the model's outputs for ``batch`` (samples along the first dimension) as a CPU tensor.

        The batch is cast to the Servable's input dtype; the engine warms up first if it was not.
        """
        if self.broken is not None:
            raise DeviceUnavailableError(
                f"the engine's device is unusable: {self.broken}\nhint: only a new process recovers it; restart"
            )
        inputs = as_batch(batch, self.servable)
        inputs = self._guarded(lambda: model_inputs(self.servable, inputs.to(self.servable.torch_dtype)))
        if not self.ready:
            self.warm_up()
        with self._lock:
            chunks = self._guarded(lambda: [self._run(part) for part in inputs.split(self.max_batch_size)])
        return torch.cat(chunks) if len(chunks) > 1 else chunks[0]

    def _run(self, part: torch.Tensor) -> torch.Tensor:
        bucket = bucket_for(len(part), self.buckets)
        return self._runner_of(bucket).run(part, bucket)

    # -- setting up: the chosen precision, compile and runner --------------------------------------

    def _set_up(self) -> None:
        """Convert the model for the plan's settings, compile it if asked, and make each bucket's runner."""
        self._planned_compile: Choice[bool] = self.plan["compile"]
        kept, small, split = self._convert()
        if kept.compiled:
            self._compile()
        runners = {s: self._runner_for(self._forward(s)) for s in {kept, small}}
        self._runners = {b: runners[small if b in split else kept] for b in self.buckets}

    def _convert(self) -> tuple[Setting, Setting, frozenset[int]]:
        """Make the model the plan's setting, and the buckets split off (if any) a copy of their own where their
        weights differ, made before the model is converted (or compiled: a compile patches the forward). Return
        the two settings (the same one twice where nothing is split off) and the buckets split off.

        A compile serves the model itself: the setting of the buckets split off keeps its own, or runs the
        compiled model's own forward eagerly (``_forward``).
        """
        kept = Setting(self.plan["precision"].value, bool(self.plan["compile"].value), self.plan["channels_last"].value)
        small, split = self._split if self._split is not None else (kept, frozenset[int]())
        small = small if self.plan["compile"].value or not small.compiled else replace(small, compiled=False)
        if not kept.compiled and not small.compiled:
            self._uncompile()
        copies = {  # the model's own weights, where another setting wants them, on a copy: the model is converted
            s.variant: variant_of(self.model, s) if s.variant == self._kept.variant else self._variant(s)
            for s in (kept, small)
            if s.variant != kept.variant
        }
        if kept.variant != self._kept.variant:  # a setting timed on a copy won: the model itself becomes it
            self.model = convert(self.model, kept)
        self._kept, self._variants = kept, copies
        return kept, small, split

    def _runner_of(self, bucket: int) -> EagerRunner | GraphRunner:
        """The runner of ``bucket``'s setting."""
        return self._runners[bucket]

    def _runner_for(self, forward: Forward) -> EagerRunner | GraphRunner:
        """The runner the plan's CUDA graph setting asks for, around ``forward``."""
        return (
            GraphRunner(forward, self.device) if self.plan["cuda_graphs"].value else EagerRunner(forward, self.device)
        )

    def _compile(self) -> CompileRecord:
        if self._record is None:
            # dynamic=False: the buckets are the only shapes, each compiled for its own size.
            self._record = compile_module(self.model, per_bucket=True, dynamic=False)
        return self._record

    def _uncompile(self) -> None:
        if self._record is None:
            return
        if self._own_forward:
            self.model.forward = self._record.eager
        else:
            vars(self.model).pop("forward", None)
        self._record = None

    def _compile_room(self) -> contextlib.AbstractContextManager[Any]:
        """Room for a graph per bucket and precision beyond those torch.compile holds (runtime.compile says why)."""
        return recompile_room(self._record, 2 * len(self.buckets) + 2)

    def _warm_buckets(self) -> None:
        try:
            with self._compile_room():
                for bucket in sorted(self.buckets, reverse=True):  # largest first: smaller graphs reuse its pool
                    if self._stop is not None and self._stop.is_set():
                        raise WarmUpStopped(f"the warm-up was stopped before the bucket of {bucket}")
                    self._runner_of(bucket).prepare(bucket, self._zeros(bucket))
        except CaptureFailed as exc:
            self._fall_back("cuda_graphs", exc.without_graphs())
            self._warm_buckets()
        except Exception as exc:
            if self._record is None or not is_compiler_error(exc):
                raise
            self._fall_back("compile", f"compile failed, ran eagerly: {describe_error(exc)}")
            self._warm_buckets()

    def _fall_back(self, axis: str, reason: str) -> None:
        log.warning("InferenceEngine: %s; %s off", reason, axis)
        self.plan[axis] = Choice(False, reason)
        if axis == "compile" and self._eager_split is not None:  # split again against the compile (_split_again)
            eager, self._eager_split = self._eager_split, None
            gone = Choice(None, "one setting serves every bucket: the compile, faster on every bucket, fell back")
            self._split, self.plan["small_batches"] = eager if self._split is not None else (None, gone)  # copy held?
        if self._split is not None and (axis == "cuda_graphs" or self._split[0].compiled):  # timed with it
            self._split = None
            self.plan["small_batches"] = Choice(None, f"one setting serves every bucket: the split was timed with "
                                                      f"{axis} on, which fell back")  # fmt: skip
        self._set_up()

    def _guarded(self, work: Any) -> Any:
        """Run ``work()``; a sticky CUDA error marks the engine broken before it propagates."""
        try:
            return work()
        except Exception as exc:
            if is_sticky_cuda_error(exc):
                self.broken = describe_error(exc)
                log.error("InferenceEngine: the device is unusable until the process restarts: %s", self.broken)
            raise

    def _zeros(self, bucket: int) -> torch.Tensor:
        return model_inputs(self.servable, torch.zeros((bucket, *self.input_shape), dtype=self.servable.torch_dtype))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- measuring the candidates ------------------------------------------------------------------

    def _measure(self, proposal: Proposal) -> None:
        """Time the proposal's settings on the largest and smallest buckets (or read them from the cache); plan by them.

        The smallest bucket is what a lightly loaded server runs: a candidate must not lose there, unless
        another setting, faster there, runs the small buckets on a second copy of the model.
        """
        largest, smallest = self.buckets[-1], self.buckets[0]
        buckets = (largest, smallest) if smallest != largest else (largest,)
        found = self._timings([proposal.reference, *proposal.candidates], buckets)
        if found is None:  # capturing failed, and the plan now runs without graphs
            self._measure(proposal)
            return
        timings, note = found
        small = (smallest, timings[smallest]) if smallest != largest else None
        chosen = choose(proposal, timings[largest], bucket=largest, small=small, split=small is not None)
        lighter = chosen.pop("small_batches", None)
        if lighter is not None and isinstance(lighter.value, Setting):
            split = self._split_off(_kept(chosen), lighter.value, timings)
            if split is None:
                self._measure(proposal)
                return
            lighter = split
            if lighter.value is None:
                chosen = choose(proposal, timings[largest], bucket=largest, small=small)
        measured = chosen["measured"]
        self.plan.update(chosen, measured=Choice(measured.value, f"{measured.reason}; {note}"))
        if lighter is not None:
            self.plan["small_batches"] = lighter
        if proposal.compile_after:
            kept = _kept(chosen)  # eager: on a CPU no compiled setting was timed with the others
            timed = next((t for t in timings[largest] if t.setting == kept), None)
            short = short_job(kept, timed, self.planned_batches)
            if short is None:
                self._time_compile(proposal)
            else:
                self.plan["compile"] = Choice(False, short)

    def _time_compile(self, proposal: Proposal) -> None:
        """Time the setting kept compiled against itself eager, on the model converted for it, on the largest and
        smallest of its buckets (the others may be split off); keep the faster."""
        kept, _, split = self._convert()
        lane = [b for b in self.buckets if b not in split]
        largest, smallest = lane[-1], lane[0]
        buckets = (largest, smallest) if smallest != largest else (largest,)
        trial = replace(proposal, reference=kept, candidates=(replace(kept, compiled=True),))
        found = self._timings([trial.reference, *trial.candidates], buckets)
        if found is None:  # no CUDA graphs here: a capture cannot fail
            return
        timings, note = found
        small = (smallest, timings[smallest]) if smallest != largest else None
        compiled = choose(trial, timings[largest], bucket=largest, small=small)["compile"]
        record = self._record
        took = f"; its compile took {record.seconds:.1f} s" if record is not None and record.seconds else ""
        self.plan["compile"] = Choice(compiled.value, f"{compiled.reason}{took}; {note}")
        if compiled.value and split:
            self._split_again(replace(kept, compiled=True), split)

    def _split_again(self, compiled: Setting, split: frozenset[int]) -> None:
        """Time the buckets split off the setting kept eager against it compiled; the other setting keeps those it
        still wins (on a Xeon with AMX, digits in bf16 compiled beat the fp32 split off at 16). The eager split is
        put back if the compile falls back, where its copy is still held."""
        assert self._split is not None
        small = self._split[0]
        if (found := self._timings([small, compiled], sorted(split))) is None:  # no CUDA graphs on a CPU
            return
        self._eager_split = (self._split, self.plan["small_batches"])
        runs, choice = split_buckets(compiled, small, found[0])
        self._split = (small, runs) if runs else None
        self.plan["small_batches"] = Choice(choice.value, f"with the compile, {choice.reason}; {found[1]}")

    def _timings(
        self, settings: Sequence[Setting], buckets: Sequence[int]
    ) -> tuple[dict[int, list[Timing]], str] | None:
        """Each bucket's timings of ``settings`` (the reference first), measured now or cached, and which;
        None where capturing a CUDA graph failed: the plan then runs without graphs, and the caller measures again."""
        graphs = bool(self.plan["cuda_graphs"].value)
        sample = self._zeros(1)  # the model's own input, after the Servable's preprocess
        key = measure_key(
            self._identity, self.facts, buckets=buckets,
            input_shape=tuple(sample.shape[1:]), input_dtype=str(sample.dtype), settings=settings, graphs=graphs,
        )  # fmt: skip
        cached = load_measured(key)
        if graphs and cached is not None and cached.capture_failed:  # this model could not be captured here
            self.plan["cuda_graphs"] = Choice(False, f"{cached.capture_failed} (cached from {cached.when})")
            return None
        if cached is not None and set(cached.timings) == set(buckets):
            return cached.timings, f"cached from {cached.when}"
        log.info(
            "InferenceEngine: timing %s on batches of %s", ", ".join(s.label for s in settings),
            " and ".join(map(str, buckets)),
        )  # fmt: skip
        for setting in settings:  # copies of the model as it is: a compile patches its forward, and a copy's
            self._variant(setting)  # forward would then be the original's
        if any(s.compiled for s in settings):
            self._compile()
        stalls = Stalls()  # counts the timed rounds alone: not the compiles, nor the runners' builds
        try:
            with self._compile_room():
                timings = {bucket: self._time(settings, bucket, stalls) for bucket in buckets}
        except CaptureFailed as exc:
            self.plan["cuda_graphs"] = Choice(False, exc.without_graphs())
            if not is_oom(exc):  # out of memory may not happen on the next start; the rest would
                store_capture_failure(key, exc.without_graphs())
            return None
        return timings, store_unless_busy(key, timings, stalls.share())

    def _split_off(self, kept: Setting, small: Setting, ends: dict[int, list[Timing]]) -> Choice[str | None] | None:
        """The small_batches entry where ``small`` beat ``kept`` on the smallest bucket: the buckets it runs, timed
        both ways on those in between; None where capturing failed (measure again)."""
        if small.variant != kept.variant:  # a second copy of the weights: only where the device has room
            memory = self.facts.mem_gib * 2**30 if self.facts.mem_gib else host_memory_bytes()
            no_room = no_room_for_copy(weight_bytes(self.model, small), memory, self.facts.type)
            if no_room:
                return Choice(None, no_room)
        middle = [b for b in self.buckets if b not in ends]
        try:
            found = self._timings([kept, small], middle) if middle else ({}, "")
        except Exception as exc:  # the kept setting failing on a bucket between (a compile): the warm-up decides
            if is_sticky_cuda_error(exc):
                raise
            return Choice(
                None, f"one setting serves every bucket: timing the buckets between failed: {describe_error(exc)}"
            )
        if found is None:
            return None
        runs, choice = split_buckets(kept, small, {**ends, **found[0]})
        self._split = (small, runs)
        return Choice(choice.value, f"{choice.reason}; {found[1]}") if found[1] else choice

    def _time(self, settings: Sequence[Setting], bucket: int, stalls: Stalls | None = None) -> list[Timing]:
        """Time ``settings`` (the reference first) on ``bucket``, each through the runner it would serve with."""
        runners = [(s, self._trial_runner(s, bucket)) for s in settings]
        return time_settings(runners, self._zeros(bucket), self._probe(bucket), sync=self._sync, stalls=stalls)

    def _trial_runner(self, setting: Setting, bucket: int) -> Any:
        """A factory of the runner for ``setting`` on ``bucket``, prepared; a compile that fell back is a failure."""

        def build() -> Any:
            runner = self._runner_for(self._forward(setting))
            runner.prepare(bucket, self._zeros(bucket))
            if setting.compiled and self._record is not None and self._record.fell_back:
                raise RuntimeError(f"compile failed: {self._record.fell_back}")
            return lambda inputs: runner.run(inputs, bucket)

        return build

    def _forward(self, setting: Setting) -> Forward:
        """The forward of ``setting``: the compiled one, or the model's own while compiled settings are timed too;
        on a converted copy of the model where its weights differ from the model's (never a compiled one)."""
        model = self._variant(setting)
        forward = make_forward(model, setting, self.device)
        record = self._record
        if model is not self.model or setting.compiled or record is None:
            return forward

        def eager(inputs: torch.Tensor) -> torch.Tensor:
            with record.eagerly():
                return forward(inputs)

        return eager

    def _variant(self, setting: Setting) -> nn.Module:
        """The model as ``setting`` runs it: the model itself, or a copy converted for it (made once)."""
        if setting.variant == self._kept.variant:
            return self.model
        if setting.variant not in self._variants:
            self._variants[setting.variant] = variant_of(self.model, setting)
        return self._variants[setting.variant]

    def _probe(self, bucket: int) -> torch.Tensor:
        """A seeded random batch for comparing outputs (zeros for integer inputs, whose valid range is unknown)."""
        dtype = self.servable.torch_dtype
        if not dtype.is_floating_point:
            return self._zeros(bucket)
        generator = torch.Generator().manual_seed(PROBE_SEED)
        return model_inputs(self.servable, torch.randn((bucket, *self.input_shape), generator=generator).to(dtype))


def _kept(chosen: dict[str, Choice[Any]]) -> Setting:
    """The setting the plan entries ``choose`` returned keep for the largest bucket."""
    return Setting(chosen["precision"].value, bool(chosen["compile"].value), chosen["channels_last"].value)
