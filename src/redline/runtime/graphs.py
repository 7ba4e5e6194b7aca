"""CUDA graphs for a training step's forward and backward, captured from the model's own eager forward.

A small model on a GPU spends its step launching kernels, not running them: on an H200 the digits CNN kept
the GPU busy 4% of its step (benchmarks/results/h200-2026-12-04.md), and torch.compile, which fuses kernels
but still launches each, made it slower. ``torch.cuda.make_graphed_callables`` captures the forward and its
backward as two CUDA graphs; a training forward then copies its inputs into the graph's and replays the
whole forward in one launch, and autograd replays the backward in one more. Nothing is compiled: the
capture runs the forward three times and records it once, milliseconds where a compile takes seconds.

Graphs are captured in training mode only. What they cannot follow runs the model's own forward, call by call:
- inputs of another shape, dtype or device than the captured ones (a partial last batch), autocast on or off
  unlike the capture, a keyword or an argument that is not a tensor: the graph would copy them wrongly;
- a forward under no_grad or in eval mode (evaluation, sampling);
- a second forward before the optimizer steps: the graph's outputs and saved activations are single
  buffers, and a second replay would overwrite the first's before its backward ran.
Inputs that stay other for ``MISFITS`` calls in a row, and a model whose parameters or layer modes changed
(layers unfrozen, parameters replaced, the model set up again), are captured anew.

At each capture the graphs are held against the model's own forward and backward on the captured batch
(``compare_with_eager``), and graphs that differ are never used. A capture that fails (a forward that
waits on the host, memory) is logged, and the model runs its own forward for the rest of the run; the
Plan says why. So is a model with hooks on its layers, which a replay would never call (``hooks_inside``).
The capture's warm-up runs the forward on the batch three times, which would move BatchNorm's running
statistics: the buffers are put back after it. Graphs let go of give their memory back.

The graph's backward hands out each gradient in a buffer of its own, which the next replay overwrites: a
hook gives autograd a copy to keep as ``.grad``, so a second backward through one forward adds up as it
would eagerly. Outputs are handed back as copies too. A graphed step back-propagates once per forward and
frees its gradients after the optimizer step, as the Runtime does on CUDA; gradient accumulation,
micro-batches and several processes keep graphs off (plan/graphs.py).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from redline.errors import ConfigError, describe_error
from redline.hardware.device import DeviceFacts
from redline.plan import Choice
from redline.plan.graphs import resolve_graphs
from redline.runtime.compile import CompileRecord, own_forward
from redline.runtime.oom import free_memory
from redline.runtime.options import RuntimeOptions
from redline.runtime.probe import kept_buffers

log = logging.getLogger("redline")

Capture = Callable[[nn.Module, tuple[torch.Tensor, ...]], Callable[..., Any]]


def capture_graphs(module: nn.Module, sample: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
    """Capture ``module``'s forward and backward on ``sample`` as CUDA graphs; return the graphed forward.

    Under autocast the capture runs with autocast's cache off, as torch requires: a cached cast would
    be a tensor from outside the graph. The module's buffers are put back after the warm-up.
    """
    own = module.forward
    autocast: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if torch.is_autocast_enabled("cuda"):
        autocast = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
    try:
        with kept_buffers(module), autocast, _thread_local_capture():
            graphed = torch.cuda.make_graphed_callables(module, sample, allow_unused_input=True)
        forward: Callable[..., Any] = graphed.forward  # type: ignore[union-attr]  # a module in, a module out
    finally:
        module.forward = own
    return forward


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hooks_inside(module: nn.Module) -> str:
    """The hooks a graphed forward would leave behind, in words, or "": a replay runs the module's own hooks around it
    (``forward_hooks_aside``) but calls none of its layers, so hooks on them (a feature tap, activation statistics)
    and hooks on every module (``register_module_forward_hook``) would run once, while the graphs are captured."""
    hooked = [name for name, layer in module.named_modules() if name and any(getattr(layer, h, None) for h in _HOOKS)]
    if hooked:
        more = f" and {len(hooked) - 3} more" if len(hooked) > 3 else ""
        return f"the hooks on its layer(s) {', '.join(hooked[:3])}{more}"
    everywhere = torch.nn.modules.module
    if any(getattr(everywhere, "_global" + h, None) for h in _HOOKS):
        return "the hooks on every module (torch.nn.modules.module.register_module_forward_hook and its kin)"
    return ""


@contextlib.contextmanager
def forward_hooks_aside(module: nn.Module) -> Iterator[None]:
    """Set ``module``'s forward hooks aside inside: torch captures no module with hooks (make_graphed_callables), and
    they need not be in the graphs, since the graphed forward becomes the module's ``forward``, and a call runs its
    hooks around it as around its own (the run's layout check, runtime/layout.py, or a hook of the user's)."""
    before, after = module._forward_pre_hooks, module._forward_hooks
    module._forward_pre_hooks, module._forward_hooks = collections.OrderedDict(), collections.OrderedDict()
    try:
        yield
    finally:
        module._forward_pre_hooks, module._forward_hooks = before, after


# The largest difference allowed between the graphed and the module's own forward, outputs and gradients alike,
# relative to the largest magnitude: kernels chosen apart round apart (TF32, bf16), a graph that reads or writes
# the wrong memory differs by far more.
TOLERANCE = 1e-2
HOST_RANDOM = (
    "the model's own forward gives another result each time even from the same random draws of the device: its "
    "randomness is the host's (Python's random, a CPU tensor's draws, a step counter), which a graph would capture "
    "once and replay forever"
)


def compare_with_eager(
    module: nn.Module, eager: Callable[..., Any], graphed: Callable[..., Any], sample: tuple[torch.Tensor, ...]
) -> tuple[float | None, str]:
    """Run ``sample`` through the module's own forward and through the graphs, each with its backward; return the
    largest relative difference of their outputs and gradients, and what it means (None: not comparable).

    The own forward runs twice first: where those two differ (dropout draws anew), so would the graphs, and only the
    shapes can be held against each other. It then runs a third time from the first's state of the random generator
    of the sample's device: where that one differs too, the forward's randomness is not the device's (Python's
    ``random``, a CPU tensor's draws, a step counter): a graph captures one branch of it and replays it forever, so
    it is refused.
    """
    generator = device_generator(sample)
    drawn = generator.get_state()
    with kept_buffers(module):
        first = _outputs_and_grads(module, eager, sample)
        again = _outputs_and_grads(module, eager, sample)
        random = _difference(first, again)
        if random is None or random > TOLERANCE:
            generator.set_state(drawn)
            host = _difference(first, _outputs_and_grads(module, eager, sample))
            if host is None or host > TOLERANCE:
                return float("inf"), HOST_RANDOM
        got = _outputs_and_grads(module, graphed, sample)
    if random is None or random > TOLERANCE:
        shapes = [tuple(t.shape) if t is not None else None for t in first]
        if shapes != [tuple(t.shape) if t is not None else None for t in got]:
            return float("inf"), "their outputs or gradients have other shapes than the model's own"
        return None, "not compared by value: the model's own forward gives another result each time (dropout)"
    worst = _difference(first, got)
    if worst is None or worst > TOLERANCE:
        return float("inf") if worst is None else worst, "their outputs or gradients differ from the model's own"
    return worst, f"outputs and gradients match the model's own forward within {worst:.1g}"


def device_generator(sample: tuple[torch.Tensor, ...]) -> torch.Generator:
    """The random generator of the device ``sample`` is on: the one dropout draws from, which a graph replays anew."""
    device = sample[0].device
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _outputs_and_grads(
    module: nn.Module, forward: Callable[..., Any], sample: tuple[torch.Tensor, ...]
) -> list[torch.Tensor | None]:
    outputs = [t for t in torch.utils._pytree.tree_leaves(forward(*sample)) if isinstance(t, torch.Tensor)]
    params = [p for p in module.parameters() if p.requires_grad]
    live = [t for t in outputs if t.requires_grad]
    grads: tuple[torch.Tensor | None, ...] = ()
    if live and params:
        grads = torch.autograd.grad(live, params, [torch.ones_like(t) for t in live], allow_unused=True)
    return [t.detach().float() for t in outputs] + [g.detach().float() if g is not None else None for g in grads]


def _difference(reference: list[torch.Tensor | None], other: list[torch.Tensor | None]) -> float | None:
    """The largest difference of each pair relative to the reference's largest magnitude (None: not the same kind)."""
    if len(reference) != len(other):
        return None
    worst = 0.0
    for a, b in zip(reference, other, strict=True):
        if a is None or b is None:
            if a is not b:
                return None
            continue
        if a.shape != b.shape:
            return None
        scale = max(float(a.abs().max()), 1e-12) if a.numel() else 1.0
        worst = max(worst, float((a - b).abs().max()) / scale if a.numel() else 0.0)
    return worst


@contextlib.contextmanager
def _thread_local_capture() -> Iterator[None]:
    """Have the captures inside refuse unsafe CUDA calls from the capturing thread only.

    ``make_graphed_callables`` captures in torch's default "global" mode, where a CUDA call that is unsafe
    during a capture fails in any thread: a DataLoader's pin-memory thread allocating pinned memory while
    the step captures would fail, and with it the run. torch.compile's CUDA graphs capture "thread_local"
    for that reason; so do these. Where torch's ``graph`` takes no such mode, its default stays.
    """
    original = torch.cuda.graph
    if "capture_error_mode" not in inspect.signature(original.__init__).parameters:
        yield
        return

    class graph(original):  # type: ignore[valid-type,misc]
        def __init__(self, cuda_graph: Any, pool: Any = None, stream: Any = None, **options: Any) -> None:
            options.setdefault("capture_error_mode", "thread_local")
            super().__init__(cuda_graph, pool=pool, stream=stream, **options)

    torch.cuda.graph = graph  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torch.cuda.graph = original  # type: ignore[misc]


MISFITS = 3  # calls in a row with the same other inputs after which the graphs are captured anew at those


@dataclass
class GraphRecord:
    """A module whose training forward and backward replay as CUDA graphs, captured on its first eligible call.

    ``use_graphed`` installs the graphed forward on the module, ``use_eager`` its own; ``stepped`` starts a
    new optimizer step (one graphed forward per step). ``capture`` is given so a test can stand in for CUDA.
    """

    module: nn.Module
    eager: Callable[..., Any]  # the module's own forward (the uncompiled one, where it is compiled too)
    capture: Capture = capture_graphs
    graphed: Callable[..., Any] | None = None  # once captured
    inputs: tuple[Any, ...] | None = None  # what the captured call's inputs were: shapes, dtypes, devices, autocast
    model: tuple[Any, ...] | None = None  # what the captured model was: its parameters (which, trainable) and modes
    compared: str = ""  # how the graphs compared with the module's own forward on the captured batch
    failed: str | None = None  # why graphs are off for good ("the capture failed: ..."): the module runs its own
    seconds: float = 0.0  # the captures' time, warm-ups and comparisons included
    captures: int = 0
    replays: int = 0  # training forwards that ran as graphs
    eager_calls: int = 0  # forwards the graph could not take, while graphs were in use
    used_this_step: bool = False
    calls_this_step: int = 0  # training forwards of the module since the last step, graphed or not
    on: bool = False  # whether the module's forward is the graphed one
    _misfit: tuple[Any, int] = (None, 0)
    _hooks: list[Any] = field(default_factory=list)

    def use_graphed(self) -> None:
        """Have the module's training forward replay the graphs from now on (captured on its next eligible call)."""
        if self.failed is None:
            self.module.forward = self._forward
            self.on = True
            self._arm()

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.on:  # a copy's record (an EMA's), or one set aside: the module's own forward
            return self.eager(*args, **kwargs)
        return self.call(args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphRecord:
        """A copy of the module (an EMA or a teacher, by ``copy.deepcopy``) gets a record of its own, with no graphs:
        the captured ones read and write the original's parameters, and their hooks are the original's."""
        return GraphRecord(copy.deepcopy(self.module, memo), copy.deepcopy(self.eager, memo), capture=self.capture)

    def stop(self, reason: str) -> None:
        """Turn graphs off for the rest of the run, for ``reason`` (the Plan says it), and free their memory."""
        self.failed = reason
        self.drop()

    def use_eager(self) -> None:
        """Have the module run its own forward from now on."""
        if self.on:
            self.module.forward = self.eager
            self.on = False
        self._disarm()

    def drop(self) -> None:
        """Have the module run its own forward for good, and let go of the graphs and their memory."""
        self.use_eager()
        self.release()

    def release(self) -> None:
        """Let go of the captured graphs and their memory pool (a later eligible call captures anew)."""
        self._disarm()
        had = self.graphed is not None
        self.graphed, self.inputs, self.model, self._misfit = None, None, None, (None, 0)
        if had:
            device = next((p.device for p in self.module.parameters()), None)
            if device is not None:
                free_memory(device)

    @contextlib.contextmanager
    def eagerly(self) -> Iterator[None]:
        """Run the module's own forward inside (evaluation, sampling), whatever form it is in."""
        with own_forward(self.module, self.eager):
            yield

    def turned_off(self, planned: str) -> Choice[bool]:
        """The axis once graphs were turned off for good: the plan's reason (``planned``), then why."""
        return Choice(False, f"{planned}, but off: {self.failed}; the model runs its own forward")

    def explain(self, planned: Choice[bool]) -> Choice[bool]:
        """The axis for graphs asked for (no check): captured, or off and why."""
        if not planned.value:
            return planned
        if self.failed is not None:
            return self.turned_off(planned.reason)
        if not self.replays:
            return Choice(
                True,
                f"{planned.reason}; no training forward replayed yet ({self.eager_calls} ran the model's own: a "
                "keyword or non-tensor argument, no_grad or eval mode, or a second forward in a step)",
            )
        replayed = f"captured {self.captures} time(s) in {self.seconds:.2f} s ({self.compared})"
        return Choice(True, f"{planned.reason}; {replayed}, {self.replays} forward(s) replayed, {self.eager_calls} not")

    def stepped(self) -> None:
        """An optimizer step happened: the next training forward may replay the graphs again."""
        self.used_this_step, self.calls_this_step = False, 0

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The forward while graphs are in use: the graphs where they can follow the call, else the module's own."""
        first = self.calls_this_step == 0  # a capture happens only there: before any backward of the step is pending
        if torch.is_grad_enabled() and self.module.training:
            self.calls_this_step += 1
        if not self._eligible(args, kwargs):
            self.eager_calls += 1
            return self.eager(*args, **kwargs)
        inputs, model = _inputs_of(args), _model_of(self.module)
        if self.graphed is not None and model != self.model and first:  # parameters unfrozen or replaced, a mode
            self.release()  # changed
        if self.graphed is not None and inputs != self.inputs:
            if not (self._persists(inputs) and first):  # a partial last batch, a forward outside autocast
                self.eager_calls += 1
                return self.eager(*args, **kwargs)
            self.release()  # the batches have these inputs now (the first capture may have seen an odd one)
        elif self.graphed is not None:
            self._misfit = (None, 0)  # in a row: a call that fits breaks the run of other inputs
        if self.graphed is not None and model != self.model:
            self.eager_calls += 1  # the model changed mid-step: captured anew at the next step's first forward
            return self.eager(*args, **kwargs)
        if self.graphed is None:
            if not first:
                self.eager_calls += 1
                return self.eager(*args, **kwargs)
            self._capture(args, inputs, model)
            if self.graphed is None:
                return self.eager(*args, **kwargs)
        self.used_this_step = True
        self.replays += 1
        # Copied out of the graph's buffers, which the next replay overwrites: a loop that keeps the outputs (an
        # epoch's logits for a metric) keeps what it saw.
        return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, self.graphed(*args))

    def _eligible(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the call is a training forward a graph can take at all (captured in training mode only)."""
        if kwargs or self.used_this_step or not torch.is_grad_enabled() or not args or not self.module.training:
            return False
        return all(isinstance(a, torch.Tensor) and not a.requires_grad for a in args)

    def _persists(self, inputs: tuple[Any, ...]) -> bool:
        """Count a call whose inputs differ from the captured ones; whether they came ``MISFITS`` times in a row."""
        seen, count = self._misfit
        self._misfit = (inputs, count + 1 if seen == inputs else 1)
        return self._misfit[1] >= MISFITS

    def _capture(self, args: tuple[torch.Tensor, ...], inputs: tuple[Any, ...], model: tuple[Any, ...]) -> None:
        if hooked := hooks_inside(self.module):
            self.stop(f"{hooked} would run while the graphs are captured and never as they replay")
            log.warning("CUDA graphs are not used for %s: %s", type(self.module).__name__, self.failed)
            return
        sample = tuple(a.detach().clone() for a in args)
        start = time.perf_counter()
        current, self.module.forward = self.module.forward, self.eager  # the capture runs the module's own forward
        try:
            with forward_hooks_aside(self.module):
                graphed = self.capture(self.module, sample)
            worst, said = compare_with_eager(self.module, self.eager, graphed, sample)
        except Exception as exc:  # the model's own forward still works: it runs from now on, and the Plan says why
            self.seconds += time.perf_counter() - start
            self.module.forward = current
            self.stop(f"the capture failed: {describe_error(exc)}")
            log.warning(
                "CUDA graphs could not capture %s (%s); it runs its own forward\nhint: pass cuda_graphs='off' to skip "
                "the attempt",
                type(self.module).__name__,
                self.failed,
            )
            return
        self.module.forward = current
        self.seconds += time.perf_counter() - start
        self.captures += 1
        if worst is not None and worst > TOLERANCE:  # a graph that would train the model wrong is never used
            by = "" if said == HOST_RANDOM else f" (by {worst:.3g} at most, more than {TOLERANCE:g})"
            self.stop(f"the graphs were captured, but {said}{by}")
            log.warning("CUDA graphs of %s are not used: %s", type(self.module).__name__, self.failed)
            return
        self.compared = said
        self.graphed, self.inputs, self.model = graphed, inputs, model
        self._arm()

    def _arm(self) -> None:
        """While graphs are in use: the graph hands out each gradient in a buffer of its own, which autograd would
        keep as .grad and the next replay overwrite (a second backward through the same forward, retain_graph,
        would count only its own); a hook gives autograd a copy instead."""
        if self._hooks or self.graphed is None or not self.on:
            return
        for param in self.module.parameters():
            if param.requires_grad:
                self._hooks.append(param.register_hook(torch.clone))

    def _disarm(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _inputs_of(args: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """What a graph captured for these inputs can replay: their shapes, dtypes and devices, and autocast's state."""
    autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
    return (tuple((tuple(a.shape), a.dtype, a.device) for a in args), autocast)


def _model_of(module: nn.Module) -> tuple[Any, ...]:
    """What a graph captured of this module holds to: which parameters, where their memory is, which are trained,
    and each layer's train/eval mode."""
    params = tuple((id(p), p.data_ptr(), p.requires_grad) for p in module.parameters())
    return params, tuple(m.training for m in module.modules())


def setup_graphs(
    model: nn.Module,
    options: RuntimeOptions,
    facts: DeviceFacts,
    *,
    world_size: int,
    strategy: str = "single",
    records: list[CompileRecord],
    current: GraphRecord | None,
) -> tuple[Choice[bool], GraphRecord | None]:
    """Resolve the CUDA graphs axis for ``model`` and, where it says so, give it a record (``current``: the record
    of a model set up before, which a second model turns off: a graphed step is one model's forward and backward)."""
    planned = resolve_graphs(
        options.cuda_graphs, facts, compile=options.compile, compile_mode=options.compile_mode, strategy=strategy,
        world_size=world_size, grad_accum=options.grad_accum, micro_batch=options.micro_batch,
        checkpointing=options.activation_checkpointing,
    )  # fmt: skip
    if not planned.value:
        return planned, current
    if current is not None and current.module is not model:
        if options.cuda_graphs == "on":
            raise ConfigError(
                "cuda_graphs='on' graphs one model's forward and backward, and a second model was set up\n"
                "hint: pass cuda_graphs='auto' (graphs where one model trains) or 'off'"
            )
        current.stop("a second model was set up (a graphed step is one model's forward and backward)")
        return Choice(False, f"{planned.reason}, but off: a second model was set up"), current
    if current is not None:  # set up again (layers unfrozen, another optimizer): captured anew on its next step
        current.release()
    else:
        compiled = next((r for r in records if r.module is model), None)
        current = GraphRecord(model, compiled.eager if compiled is not None else model.forward)
        if options.cuda_graphs == "on":
            current.use_graphed()
    return planned, current
