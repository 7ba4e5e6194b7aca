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
built (serve/measure.py), and cached on disk.
A sticky CUDA error (an illegal memory access, a device-side assert) marks the engine ``broken``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from redline.errors import ConfigError, DeviceUnavailableError, ServableError, describe_error, invalid
from redline.hardware.device import probe_accelerators, probe_device
from redline.plan import Choice, parse_switch
from redline.plan.device import resolve_device
from redline.plan.inference import (
    Proposal,
    Setting,
    Timing,
    check_cuda_graphs,
    check_inference_precision,
    choose,
    propose,
    read_measure,
    resolve_cuda_graphs,
)
from redline.plan.layout import has_conv2d
from redline.runtime.compile import (
    CompileRecord,
    compile_module,
    compile_supported,
    explain_compile,
    is_compiler_error,
)
from redline.runtime.cuda_errors import is_sticky_cuda_error
from redline.runtime.oom import is_oom
from redline.serve.batcher import bucket_for, bucket_sizes
from redline.serve.measure import (
    load_measured,
    measure_key,
    store_capture_failure,
    store_measured,
    time_settings,
    weights_digest,
)
from redline.serve.runners import (
    CaptureFailed,
    EagerRunner,
    Forward,
    GraphRunner,
    convert,
    make_forward,
    variant_of,
)
from redline.serve.servable import Servable, shape_text
from redline.task import model_fingerprint

log = logging.getLogger("redline")

PROBE_SEED = 0  # the random batch on which each candidate's outputs are compared with the reference's


def check_engine_options(
    *,
    device: str,
    precision: str,
    compile: str | bool,
    cuda_graphs: str | bool,
    measure: str | bool,
    channels_last: str | bool = "auto",
) -> None:
    """Refuse an engine option that cannot work here, before a model is built (the engine finds it only after).

    A device this machine lacks is a DeviceUnavailableError; a value no engine takes, or CUDA graphs
    asked of a device that is not CUDA, a ConfigError naming the argument.
    """
    chosen = resolve_device(device, probe_accelerators())
    check_inference_precision(precision)
    parse_switch("compile", compile)
    parse_switch("channels_last", channels_last)
    check_cuda_graphs(cuda_graphs, torch.device(chosen.value).type)
    read_measure(measure)


def _engine_device(device: str) -> Choice[str]:
    """The device ``device`` names, its errors saying ``device=`` (the resolver says the Runtime's ``devices=``).

    check_engine_options keeps the resolver's word: the command line turns it into --device.
    """
    try:
        return resolve_device(device, probe_accelerators())
    except ConfigError as error:
        if error.parts is None or error.parts[0] != "devices":
            raise
        _, value, allowed, hint = error.parts
        raise invalid("device", value, allowed, hint.replace("devices=", "device=")) from None
    except DeviceUnavailableError as error:
        raise DeviceUnavailableError(str(error).replace("devices=", "device=")) from error.__cause__


def as_servable(model: Servable | nn.Module, input_shape: Sequence[int] | None, input_dtype: str | None) -> Servable:
    """Return ``model`` as a Servable: itself, or a bare module with the input's shape and dtype given."""
    if isinstance(model, Servable):
        if input_shape is not None or input_dtype is not None:
            given = input_shape if input_shape is not None else input_dtype
            says = f"the Servable already names them: {model.input_shape}, {model.input_dtype}"
            raise invalid("input_shape", given, "nothing when a Servable is passed", says)
        return model
    if not isinstance(model, nn.Module):
        raise invalid(
            "model", type(model).__name__, "an nn.Module (with input_shape=...) or a redline.Servable",
            "wrap a plain function in an nn.Module",
        )  # fmt: skip
    if input_shape is None:
        raise ConfigError(
            f"InferenceEngine({type(model).__name__}) needs input_shape: one sample's shape, without the batch\n"
            "hint: InferenceEngine(model, input_shape=(3, 32, 32)), or pass a redline.Servable"
        )
    shape = tuple(input_shape) if isinstance(input_shape, Sequence) else input_shape  # a lone 4: Servable says why
    return Servable(model=model, input_shape=shape, input_dtype=input_dtype or "float32", name=type(model).__name__)


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
        max_batch_size: int = 32,
        batch_buckets: Sequence[int] | str = "auto",
    ) -> None:
        self.servable = as_servable(model, input_shape, input_dtype)
        self.max_batch_size = max_batch_size
        self.buckets = bucket_sizes(max_batch_size, batch_buckets)
        chosen_device = _engine_device(device)
        self.device = torch.device(chosen_device.value)
        self.facts = probe_device(self.device)
        proposal = propose(
            self.facts, precision=precision, compile=compile, measure=read_measure(measure),
            compile_supported=lambda: compile_supported(self.facts.type), channels_last=channels_last,
            convolutional=has_conv2d(self.servable.model),
        )  # fmt: skip
        shown = "powers of two up to max_batch_size" if batch_buckets == "auto" else "requested"
        self.plan: dict[str, Choice[Any]] = {
            "device": chosen_device,
            "precision": proposal.precision,
            "compile": proposal.compile,
            "channels_last": proposal.channels_last,
            "cuda_graphs": resolve_cuda_graphs(cuda_graphs, self.facts),
            "buckets": Choice(self.buckets, f"{shown}; a batch is padded up to the next bucket"),
        }
        self.model = convert(self.servable.model.to(self.device).eval(), proposal.reference)
        self._kept = proposal.reference  # the setting the model is converted for
        self._variants: dict[tuple[str, bool], nn.Module] = {}  # copies other settings are timed on
        self.ready = False
        self.broken: str | None = None  # set when an error left the device unusable (a sticky CUDA error)
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None  # set while warming up: asked to stop between buckets
        self._record: CompileRecord | None = None
        self._own_forward = "forward" in vars(self.model)  # a forward set on the instance, put back on uncompile
        if proposal.candidates:
            self._guarded(lambda: self._measure(proposal))
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
        inputs = self._as_batch(batch)
        inputs = self._guarded(lambda: self._model_inputs(inputs.to(self.servable.torch_dtype)))
        if not self.ready:
            self.warm_up()
        with self._lock:
            chunks = self._guarded(
                lambda: [
                    self._runner.run(part, bucket_for(len(part), self.buckets))
                    for part in inputs.split(self.max_batch_size)
                ]
            )
        return torch.cat(chunks) if len(chunks) > 1 else chunks[0]

    def _as_batch(self, batch: Any) -> torch.Tensor:
        """``batch`` as a tensor of real numbers with the input's sample shape, or a ConfigError naming what it is."""
        expected = shape_text(("N", *self.input_shape))
        real = f"real numbers, shape {expected}, cast to {self.servable.input_dtype}"
        try:
            inputs = torch.as_tensor(batch)
        except (TypeError, ValueError, RuntimeError) as exc:  # text, objects, ragged lists
            what = f"array of {batch.dtype}" if isinstance(batch, np.ndarray) else type(batch).__name__
            hint = f"pass a tensor, a numpy array of numbers, or nested lists of equal lengths ({exc})"
            raise invalid("batch", what, real, hint) from None
        if inputs.is_complex():  # a cast would drop the imaginary part without a word
            raise invalid("batch", str(inputs.dtype).removeprefix("torch."), real, "pass batch.real if that is meant")
        if inputs.ndim != len(self.input_shape) + 1 or tuple(inputs.shape[1:]) != self.input_shape:
            one = tuple(inputs.shape) == self.input_shape
            hint = f"one sample? add the batch dimension: batch[None] has shape {shape_text((1, *self.input_shape))}"
            hint = hint if one else ""
            raise invalid("batch", f"shape {tuple(inputs.shape)}", expected, hint)
        _refuse_changed_by_cast(inputs, self.servable.torch_dtype)
        return inputs

    # -- setting up: the chosen precision, compile and runner --------------------------------------

    def _set_up(self) -> None:
        self._planned_compile: Choice[bool] = self.plan["compile"]
        kept = Setting(self.plan["precision"].value, bool(self.plan["compile"].value), self.plan["channels_last"].value)
        if kept.variant != self._kept.variant:  # a setting timed on a copy won: the model itself becomes it
            self.model = convert(self.model, kept)
        self._kept, self._variants = kept, {}
        if kept.compiled:
            self._compile()
        else:
            self._uncompile()
        self._runner = self._runner_for(make_forward(self.model, kept, self.device))

    def _runner_for(self, forward: Forward) -> EagerRunner | GraphRunner:
        """The runner the plan's CUDA graph setting asks for, around ``forward``."""
        return (
            GraphRunner(forward, self.device) if self.plan["cuda_graphs"].value else EagerRunner(forward, self.device)
        )

    def _compile(self) -> CompileRecord:
        if self._record is None:
            # dynamic=False: the buckets are the only shapes, each compiled for its own size.
            self._record = compile_module(self.model, dynamic=False)
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
        """Let torch.compile keep a graph per bucket and precision: its default limit (8) falls back to eager beyond."""
        if self._record is None:
            return contextlib.nullcontext()
        import torch._dynamo.config as dynamo_config

        name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        need = max(int(getattr(dynamo_config, name)), 2 * len(self.buckets) + 2)
        return dynamo_config.patch(name, need)

    def _warm_buckets(self) -> None:
        try:
            with self._compile_room():
                for bucket in sorted(self.buckets, reverse=True):  # largest first: smaller graphs reuse its pool
                    if self._stop is not None and self._stop.is_set():
                        raise WarmUpStopped(f"the warm-up was stopped before the bucket of {bucket}")
                    self._runner.prepare(bucket, self._zeros(bucket))
        except CaptureFailed as exc:
            self._fall_back("cuda_graphs", _without_graphs(exc))
            self._warm_buckets()
        except Exception as exc:
            if self._record is None or not is_compiler_error(exc):
                raise
            self._fall_back("compile", f"compile failed, ran eagerly: {describe_error(exc)}")
            self._warm_buckets()

    def _fall_back(self, axis: str, reason: str) -> None:
        log.warning("InferenceEngine: %s; %s off", reason, axis)
        self.plan[axis] = Choice(False, reason)
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
        return self._model_inputs(torch.zeros((bucket, *self.input_shape), dtype=self.servable.torch_dtype))

    def _model_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's batch for ``inputs``: the Servable's ``preprocess`` applied, its row count checked."""
        preprocess = self.servable.preprocess
        if preprocess is None:
            return inputs
        made = preprocess(inputs)
        if not isinstance(made, torch.Tensor) or made.ndim == 0 or made.shape[0] != inputs.shape[0]:
            got = f"shape {tuple(made.shape)}" if isinstance(made, torch.Tensor) else type(made).__name__
            raise ServableError(
                f"preprocess returned {got} for {inputs.shape[0]} samples; expected a tensor of as many rows"
            )
        return made

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- measuring the candidates ------------------------------------------------------------------

    def _measure(self, proposal: Proposal) -> None:
        """Time the proposal's settings on the largest and smallest buckets (or read them from the cache); plan by them.

        The smallest bucket is what a lightly loaded server runs: a candidate must not lose there.
        """
        largest, smallest = self.buckets[-1], self.buckets[0]
        buckets = (largest, smallest) if smallest != largest else (largest,)
        settings = [proposal.reference, *proposal.candidates]
        graphs = bool(self.plan["cuda_graphs"].value)
        sample = self._zeros(1)  # the model's own input, after the Servable's preprocess
        key = measure_key(
            f"{model_fingerprint(self.model)}:{weights_digest(self.model)}", self.facts, buckets=buckets,
            input_shape=tuple(sample.shape[1:]), input_dtype=str(sample.dtype), settings=settings, graphs=graphs,
        )  # fmt: skip
        cached = load_measured(key)
        if graphs and cached is not None and cached.capture_failed:  # this model could not be captured here
            self.plan["cuda_graphs"] = Choice(False, f"{cached.capture_failed} (cached from {cached.when})")
            self._measure(proposal)
            return
        if cached is not None and set(cached.timings) == set(buckets):
            timings, note = cached.timings, f"cached from {cached.when}"
        else:
            log.info(
                "InferenceEngine: timing %s on batches of %s", ", ".join(s.label for s in settings),
                " and ".join(map(str, buckets)),
            )  # fmt: skip
            for setting in settings:  # copies of the model as it is: a compile patches its forward, and a copy's
                self._variant(setting)  # forward would then be the original's
            if any(s.compiled for s in settings):
                self._compile()
            try:
                with self._compile_room():
                    timings = {bucket: self._time(settings, bucket) for bucket in buckets}
            except CaptureFailed as exc:
                self.plan["cuda_graphs"] = Choice(False, _without_graphs(exc))
                if not is_oom(exc):  # out of memory may not happen on the next start; the rest would
                    store_capture_failure(key, _without_graphs(exc))
                self._measure(proposal)
                return
            store_measured(key, timings)
            note = "measured now"
        small = (smallest, timings[smallest]) if smallest != largest else None
        chosen = choose(proposal, timings[largest], bucket=largest, small=small)
        measured = chosen["measured"]
        self.plan.update(chosen, measured=Choice(measured.value, f"{measured.reason}; {note}"))

    def _time(self, settings: Sequence[Setting], bucket: int) -> list[Timing]:
        """Time ``settings`` (the reference first) on ``bucket``, each through the runner it would serve with."""
        runners = [(s, self._trial_runner(s, bucket)) for s in settings]
        return time_settings(runners, self._zeros(bucket), self._probe(bucket), sync=self._sync)

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
        return self._model_inputs(torch.randn((bucket, *self.input_shape), generator=generator).to(dtype))


def _refuse_changed_by_cast(inputs: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse a batch holding a value the cast to ``dtype`` would change without a word (300 becomes 44 in uint8,
    NaN a large negative integer, 1e6 infinity in float16), naming the first row that holds one."""
    if inputs.dtype == dtype or inputs.numel() == 0:
        return
    # widened: a bound compared with a narrow tensor is cast to its dtype (int8 against int64's bounds overflows)
    values = inputs.double() if inputs.is_floating_point() else inputs.long()
    if dtype == torch.bool:
        bad, allowed = (values != 0) & (values != 1), "0 or 1 (False or True)"
    elif dtype.is_floating_point:
        largest = torch.finfo(dtype).max
        bad, allowed = values.isfinite() & (values.abs() > largest), f"values within {dtype}'s range ±{largest:.6g}"
    else:
        info = torch.iinfo(dtype)
        bad = (values < info.min) | (values > info.max)
        if inputs.is_floating_point():
            bad |= ~values.isfinite() | (values != values.round())
        allowed = f"whole numbers within {dtype}'s range [{info.min}, {info.max}]"
    if not bool(bad.any()):
        return
    row = int(bad.reshape(len(bad), -1).any(dim=1).int().argmax())
    value = inputs[row][bad[row]][0].item()
    raise invalid(
        "batch", f"row {row} holding {value!r}", str(allowed).replace("torch.", ""),
        f"the cast to the input dtype {str(dtype).removeprefix('torch.')} would change it without a word; check the "
        "inputs, or give the model a wider input_dtype",
    )  # fmt: skip


def _without_graphs(exc: CaptureFailed) -> str:
    """The reason CUDA graphs were turned off."""
    return f"capture failed, running without graphs: {describe_error(exc)}"
