"""Runtime: keep your own training loop, and run it as fast as this machine allows.

with Runtime() as rt:
    model, optimizer = rt.setup(model, optimizer)
    for inputs, targets in rt.setup_loader(loader):
        with rt.autocast():
            loss = loss_fn(model(inputs), targets)
        rt.backward(loss)      # or: rt.train_step(lambda b: loss_fn(model(b[0]), b[1]), (inputs, targets))
        rt.step(optimizer)
    rt.save("checkpoints/step-00001000")
print(rt.explain())

Every "auto" is decided by a pure resolver in redline.plan, into a Plan whose choices carry their
reasons; the Runtime asks one object per axis to apply it: a Precision (autocast, loss scaling) and
a Strategy (wrapping, gradient sync, checkpoints). What a run sets for the whole process (seeds,
TF32, deterministic algorithms, a launched worker's process group) is entered when the Runtime
starts (``with``, ``start()``, or the first ``setup()``) and left when it closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from redline.config import call_refused, one_of, positive_int
from redline.errors import ConfigError, invalid
from redline.hardware.device import DeviceFacts, probe_accelerators, probe_device
from redline.parallel.collectives import peers_said
from redline.parallel.env import join_process_group, read_env
from redline.plan import Choice, Plan
from redline.plan.attention import DEFAULT, KERNELS, resolve_attention
from redline.plan.device import resolve_worker_device
from redline.plan.inference import check_cuda_graphs
from redline.plan.optimizer import OptimizerImpl, optimizer_facts, resolve_zero_grad
from redline.plan.precision import PRECISIONS, PrecisionName, resolve_precision, resolve_tf32
from redline.plan.process import resolve_deterministic, resolve_seed
from redline.plan.strategy import resolve_strategy
from redline.runtime.attention import prefer_kernel
from redline.runtime.checkpointing import ActivationCheckpointing
from redline.runtime.compile import CompileRecord, compile_planned
from redline.runtime.compile_check import CompileCheck
from redline.runtime.cycle import Cycle, hang_watchdog
from redline.runtime.forms import FormsReport, OptimizerRow, check_forms
from redline.runtime.fused import pick_implementation
from redline.runtime.graphs import GraphRecord, setup_graphs
from redline.runtime.kernel_check import KernelCheck
from redline.runtime.layout import Layout
from redline.runtime.loading import DeviceLoader, plan_loader, tuned_dataloader
from redline.runtime.loss import check_loss
from redline.runtime.micro import BatchRun, MicroBatcher, OomEvent
from redline.runtime.oom import peak_memory_share
from redline.runtime.optimizer import (
    OptimizerLike,
    check_materialized,
    check_trainable,
    group_options,
)
from redline.runtime.options import RuntimeOptions
from redline.runtime.precision import Precision, half_model_keeps_fp32
from redline.runtime.precision_check import propose_checks
from redline.runtime.sampling import global_batches, split_caveats, split_reason
from redline.runtime.seed import warn_seeded_late
from redline.runtime.settings import ProcessSettings
from redline.runtime.state import RunState
from redline.runtime.strategy import Strategy, build_strategy, explained
from redline.runtime.tuned import Tuning, tuned_for_model

# a backward whose gradient reduction broke: a peer died, or a loop of the user's gave its ranks unequal steps
_UNEVEN = (
    "another rank stopped first (its log says why), or ran fewer steps: every rank calls backward as often as the "
    "others (rt.setup_loader gives each rank the same number of batches)"
)


class Runtime(FormsReport, RunState):
    """Accelerate a plain PyTorch loop: device, precision, compile, layout, optimizer, loading and checkpoints.

    Pass a ``RuntimeOptions`` or its fields as keywords (``Runtime(precision="bf16-mixed")``). ``planned_steps`` tells
    the compile decision how long the run is; without it, "auto" does not compile, since a compile that never repays
    itself would make the run slower. ``measured`` holds choices a trial of the user's model made for "auto" axes
    (``{"precision": Choice(...)}``, from ``runtime.trial``); they replace the rule of thumb's; an ``"optimizer"``
    among them is the implementation ("fused" or "as given") a resumed run's checkpoint stepped with, kept untimed.
    Under ``redline launch --hang-timeout S`` it watches for a rank that stops progressing (``watch_hangs=False``: a
    caller watches its own).
    """

    def __init__(
        self,
        options: RuntimeOptions | None = None,
        *,
        planned_steps: int | None = None,
        measured: Mapping[str, Choice[str]] | None = None,
        plan: str = "auto",
        watch_hangs: bool = True,
        **fields: Any,
    ) -> None:
        self.options = RuntimeOptions.build(options, **fields)
        one_of("plan", plan, ("auto", "tuned"))
        self._tuning: Tuning | None = None
        self._wants_tuned = plan == "tuned"
        positive_int("planned_steps", planned_steps, optional=True)
        self.planned_steps, self._watch_hangs = planned_steps, watch_hangs
        self.env = read_env()
        local_rank = self.env.local_rank if self.env.distributed else None
        device = resolve_worker_device(self.options.devices, probe_accelerators(), local_rank=local_rank)
        self.device = torch.device(device.value)
        self.facts: DeviceFacts = probe_device(self.device)
        check_cuda_graphs(self.options.cuda_graphs, self.facts.type)  # "on" off CUDA: refused before any work
        chosen = resolve_precision(self.options.precision, self.facts)
        self._measured = set(measured) if measured is not None else None  # None: no trial's word (a user's loop)
        stored = (measured or {}).get("optimizer")  # a resumed run's: its checkpoint's implementation
        self._stored_impl = cast(OptimizerImpl, stored.value) if stored is not None else None
        if measured and "precision" in measured and self.options.precision == "auto":
            found = measured["precision"]
            one_of("measured precision", found.value, PRECISIONS)
            chosen = Choice(cast(PrecisionName, found.value), found.reason)
        self.precision = Precision(chosen.value, self.device)
        tf32, zero_grad = resolve_tf32(self.facts), resolve_zero_grad(self.facts)
        attention = resolve_attention(self.options.attention, self.facts)
        if measured and "attention" in measured and self.options.attention == "auto":  # the trial timed kernels
            attention = measured["attention"]
            one_of("measured attention", attention.value, (DEFAULT, *KERNELS))
        self.settings = ProcessSettings(
            tf32=tf32.value, deterministic=self.options.deterministic, seed=self.options.seed,
            attention=None if attention.value == DEFAULT else attention.value,
        )  # fmt: skip
        self._cycle = Cycle(self.options.grad_accum, zero_after_step=zero_grad.value == "after step")
        self._micro = MicroBatcher(self.options.micro_batch)
        self.snapshot_dir: Path | None = None  # where an out-of-memory on CUDA writes its memory snapshot
        accum, clip = self.options.grad_accum, self.options.clip_grad_norm
        self._plan = Plan(
            device=Choice(device.value, f"{device.reason} ({self.facts.name})"),
            precision=chosen,
            tf32=tf32,
            attention=attention,
            deterministic=resolve_deterministic(self.options.deterministic),
            seed=resolve_seed(self.options.seed),
            grad_accum=Choice(accum, "requested" if self.options.given("grad_accum") else "default: a step per batch"),
            micro_batch=self._micro.choice,
            clip_grad_norm=Choice(clip, "requested" if clip else "default: no clipping"),
            zero_grad=zero_grad,
        )
        self.strategy: Strategy | None = None
        self.model: nn.Module | None = None  # the set-up (wrapped) model and its optimizer: what save() writes
        self._models: list[nn.Module] = []  # every set-up model: train_step accumulates into all of them
        self._optimizer_rows = []  # how each one's optimizer steps, for the Plan
        self._built_options = []
        self.optimizer: torch.optim.Optimizer | None = None
        self._started: contextlib.ExitStack | None = None
        self._entered = 0
        self._compile_records: list[CompileRecord] = []
        self._compile_check: CompileCheck | None = None  # auto compile, graphs and precision, checked on first steps
        self._graphs: GraphRecord | None = None  # the model whose training forward and backward may replay CUDA graphs
        self._split_caveats: list[str] = []  # the model's layers that depend on how the batch is split
        self._checkpointing = ActivationCheckpointing()
        self._layout = Layout(self.facts, world_size=self.env.world_size, eagerly=self.eager)  # channels_last
        self._kernels: KernelCheck | None = None  # the attention kernels timed on the run's own calls (propose_checks)

    # -- the run's process-wide state ------------------------------------------------------------

    def start(self) -> Runtime:
        """Join a launched job's process group and apply the process-wide settings (the seed at the first start
        only); nothing happens twice. ``setup()`` starts it if it was not; ``close()`` undoes it."""
        if self._started is not None:
            return self
        if self._cycle.closed:
            raise ConfigError(
                "this Runtime was closed: its process-wide settings were put back and its process group left\n"
                "hint: build a new Runtime for another run"
            )
        stack = contextlib.ExitStack()
        stack.enter_context(join_process_group(self.env, self.device.type))
        stack.enter_context(self.settings.enter())
        self.settings = dataclasses.replace(self.settings, seed=None)  # seeded once: a restart or a turn draws on
        watchdog = hang_watchdog(self.env, self.snapshot_dir) if self._watch_hangs else None
        self._cycle.watchdog = stack.enter_context(watchdog) if watchdog is not None else None
        if self._kernels is not None:  # a kernel the precision check chose, given back while paused
            stack.enter_context(self._kernels.held())
        self._started = stack
        return self

    def pause(self) -> None:
        """Put back the process-wide settings and leave the process group until ``start()``; the models keep the run's
        checks (several Runtimes taking turns in one process, a bench's rows: ``with rt.turn()`` per turn)."""
        stack, self._started = self._started, None
        if stack is not None:
            stack.close()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """The process-wide settings and the attention kernel the precision check chose, for a turn of a paused
        Runtime's steps; put back after it, so the next turn (another Runtime's) starts as this one found it."""
        settings, self.settings = self.settings, dataclasses.replace(self.settings, seed=None)  # seeded once, as start
        with settings.enter(), self._kernels.held() if self._kernels is not None else contextlib.nullcontext():
            yield

    def close(self) -> None:
        """Put back the process-wide settings and leave the process group this Runtime joined (idempotent)."""
        self._cycle.close()  # started, paused or never started: it neither starts nor trains, nor hooks an optimizer
        self.precision.release()  # nor does the fp16 guard
        self.pause()
        if self._graphs is not None:  # the model runs its own forward again, and the graphs' memory is let go
            self._graphs.drop()
        if self._compile_check is not None:  # the model keeps no hook of the run's
            self._compile_check.close()
        for record in self._compile_records:  # nor its compiled forward: a later Runtime (compile off) runs it eagerly
            record.restore()
        self._layout.close()

    def __enter__(self) -> Runtime:
        started = self.start()
        self._entered += 1
        return started

    def __exit__(self, *exc: object) -> None:
        self._entered -= 1
        if self._entered == 0:  # a `with rt:` inside another (a helper's) leaves the run to the outer one
            self.close()

    # -- setup ---------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: OptimizerLike) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Place ``model`` on the device, wrap it for the strategy, build or rebuild the optimizer, compile if planned.

        ``optimizer`` is an instance built on ``model``'s parameters, or a factory params -> Optimizer. The model is
        changed in place and returned; keep using the returned optimizer. Setting the same model up again (a second
        phase with other layers unfrozen) gives it that optimizer for checkpoints.
        """
        if not isinstance(model, nn.Module):
            raise invalid("model", type(model).__name__, "a torch.nn.Module")
        check_trainable(model)
        check_materialized(model)
        if self.settings.seed is not None and not self._cycle.closed:  # not started yet: the seed comes now
            warn_seeded_late(self.settings.seed)
        self.start()
        again = any(model is known for known in self._models)  # the set-up model, with a new optimizer
        second = bool(self._models) and not again  # a GAN's: it ends the precision check, and runs as it leaves it
        if self._wants_tuned and self._tuning is None:
            self._use_tuned(model)
        self._split_caveats = split_caveats(model, self.env.world_size)
        recompute = self._checkpointing.setup(model, self.options.activation_checkpointing)  # before wrap, compile
        model.to(self.device)
        kept = half_model_keeps_fp32(model, self.precision.name, self.options.precision)  # rather than refused
        if kept is not None:
            self.precision, self._plan = Precision("fp32", self.device), dataclasses.replace(self._plan, precision=kept)
        settled = self._compile_check.settled_precision() if second and self._compile_check is not None else None
        strategy = resolve_strategy(
            self.options.strategy,
            world_size=self.env.world_size,
            params=sum(p.numel() for p in model.parameters()),
            device_mem_gib=self.facts.mem_gib,
        )
        precision = settled or self.precision.name
        layout = self._layout.setup(model, self.options.channels_last, precision, sharded=strategy.value == "fsdp")
        if strategy.value != "single" and not torch.distributed.is_initialized():
            raise invalid(
                "strategy", strategy.value, "it in the processes `redline launch` starts: it needs a process group",
                "start it with `redline launch` (or `redline train --nproc N`), or use strategy='auto'",
            )  # fmt: skip
        self.strategy = build_strategy(strategy.value, find_unused_parameters=self.options.find_unused_parameters)
        micro = self._micro.plan(strategy.value)  # "auto" under FSDP is refused here, before anything is wrapped
        model, built = self.strategy.wrap(model, optimizer, device=self.device, precision=self.precision.name)
        strategy = explained(strategy, self.strategy, find_unused_parameters=self.options.find_unused_parameters)
        facts = optimizer_facts(built, model, device=self.facts)
        if facts.has_state:  # loading its own state casts the moments onto the parameters' device
            built.load_state_dict(built.state_dict())
        impl, built = pick_implementation(
            built, facts, self.facts, sharded=strategy.value == "fsdp", deterministic=self.options.deterministic,
            stored=self._stored_impl,
        )  # fmt: skip
        planned = compile_planned(
            model, self.options, self.facts, planned_steps=self.planned_steps, records=self._compile_records
        )
        graphs, self._graphs = setup_graphs(
            model, self.options, self.facts, world_size=self.env.world_size, strategy=strategy.value,
            records=self._compile_records, current=self._graphs,
        )  # fmt: skip
        self._check_forms(planned, graphs, model, strategy.value, second=second)
        self._plan = dataclasses.replace(
            self._plan, strategy=strategy, channels_last=layout, compile=planned, cuda_graphs=graphs, optimizer=impl,
            micro_batch=micro, activation_checkpointing=recompute,
            precision=self.precision.guard(built, self._plan.precision),  # refuses float16 weights, says others' dtype
        )  # fmt: skip
        self._cycle.expect_sync = self.strategy.expect_sync
        self._cycle.adopt(built, model)
        self._layout.adopt(self.strategy.module(model), built)
        self.model, self.optimizer = model, built
        self._built_options = group_options(built)  # what a checkpoint's load is held against, a schedule aside
        if not again:
            self._models.append(model)
        self._record_optimizer(model, OptimizerRow(type(self.strategy.module(model)).__name__, built, impl))
        if self._tuning is not None:
            self.adopt_reasons(self._tuning.reasons, self._tuning.note)
        return model, built

    def enable_activation_checkpointing(self, reason: str) -> bool:
        """Have the set-up models' repeated blocks recompute their activations from now on; return whether that is new:
        for "auto" when memory runs short after setup (``reason`` says how it was found); a compiled model compiles
        again. Nothing changes when "on" or "off" was requested or no model has repeated blocks."""
        turned = self._checkpointing.enable(reason)
        if turned is not None:
            self._plan = dataclasses.replace(self._plan, activation_checkpointing=turned)
            if self._graphs is not None:  # a graph cannot recompute in its backward
                self._graphs.stop("activation checkpointing turned on")
        return turned is not None

    def _use_tuned(self, model: nn.Module) -> None:
        """Take the tuned Plan's options for this model, and its precision, before anything uses them."""
        self.options, self._tuning = tuned_for_model(model, self.facts, self.options)
        chosen, attention = resolve_precision(self.options.precision, self.facts), self._plan.attention
        self.precision = Precision(chosen.value, self.device)
        if self.options.attention not in ("auto", self.settings.attention):  # a tuned kernel: entered now, once
            attention = resolve_attention(self.options.attention, self.facts)
            self.settings = dataclasses.replace(self.settings, attention=attention.value)
            cast(contextlib.ExitStack, self._started).enter_context(prefer_kernel(attention.value))
        self._plan = dataclasses.replace(self._plan, precision=chosen, attention=attention)

    def setup_loader(self, loader: Iterable[Any], *, local_devices: int | None = None) -> DeviceLoader:
        """Return ``loader`` tuned for the device, yielding batches already on it; the Plan tells the first set up.
        ``local_devices``, the processes sharing this machine's cores, is by default those launched on it."""
        chosen = plan_loader(loader, self.facts, self.env, local_devices, workers=self.options.loader_workers)
        batches = global_batches(loader, self.env, seed=self.options.seed)
        loader = tuned_dataloader(loader, chosen.value, batches, workers=self.options.loader_workers)
        told = split_reason(self.tuned_loader(chosen), loader, self._split_caveats, self.env, self.options.grad_accum)
        self._plan = dataclasses.replace(self._plan, loader=self._plan.loader or told)  # the first loader's
        return self._layout.loader(loader, self.device)

    def to_device(self, batch: Any) -> Any:
        """Move a nested batch (tensors in tuples, lists, dicts, dataclasses) to the device.

        On CUDA the copies are non-blocking: from pinned memory one may still be reading its source when this returns,
        so a pinned buffer of your own that you refill must wait for it first (``torch.cuda.current_stream()
        .synchronize()``); ordinary (pageable) memory is read before the call returns."""
        return self._layout.move(batch, self.device)

    # -- the loop ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run the compiled models' own forward inside (evaluation, sampling): their batch sizes and
        sequence lengths vary, and each new one would compile another graph."""
        with contextlib.ExitStack() as stack:
            for record in self._compile_records:
                stack.enter_context(record.eagerly())
            if self._graphs is not None:
                stack.enter_context(self._graphs.eagerly())
            yield

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Return the context that runs the forward pass in the planned precision (and times the attention kernels on
        the first training forward's calls, in a run that starts in a reduced precision: ``propose_checks``)."""
        autocast = self.precision.autocast()
        return self._kernels.around(autocast) if self._kernels is not None else autocast

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Back-propagate ``loss``, divided over the accumulated micro-batches and scaled for fp16.

        Keyword arguments go to torch's ``backward`` (``retain_graph=True`` to back-propagate through
        the same graph again, ``inputs=[...]``). A batch may back-propagate several losses: its ``step`` call
        is what counts towards ``grad_accum``, so every loss of the cycle is divided by it.
        """
        check_loss(loss, training=True, source="backward(loss) got")
        self._cycle.next_batch()
        accum = self.options.grad_accum
        if accum > 1:
            loss = loss / accum
        with contextlib.ExitStack() as synced:
            for model, sync in self._cycle.syncs():  # each set-up model (none before setup), reducing or not
                synced.enter_context(cast(Strategy, self.strategy).gradient_sync(model, sync))
            with peers_said("rt.backward", _UNEVEN):
                self.precision.backward(loss, **kwargs)

    def train_step(self, step_fn: Callable[[Any], torch.Tensor], batch: Any) -> torch.Tensor:
        """Run ``step_fn(batch)`` (the batch's loss, under autocast) and back-propagate it; return the loss, detached.

        Its loss is divided by ``grad_accum``, as ``backward``'s; call ``step(optimizer)`` after it. With
        ``micro_batch`` N, the batch runs as micro-batches of N samples (its first axis split) whose gradients
        accumulate; with "auto" it runs whole until the device runs out of memory, then is done again in halves
        (runtime/micro.py). ``oom_events`` lists each recovery.
        """
        strategy, _, _ = self._prepared(models=False)
        if not callable(step_fn) or call_refused(step_fn, 1):  # called later, its TypeError would be redline's
            hint = "pass the function itself, which takes the batch: "
            hint += "rt.train_step(lambda b: loss_fn(model(b[0]), b[1]), batch)"
            raise invalid("train_step(step_fn)", type(step_fn).__name__, "a function batch -> loss", hint)
        sync = self._cycle.next_batch("train_step")
        step = self._cycle.current_step
        how = BatchRun(precision=self.precision, strategy=strategy, models=self._models, device=self.device,
                    accum=self.options.grad_accum, sync=sync, step=step, fresh=self._cycle.fresh(),
                    snapshot_dir=self.snapshot_dir,
                    recompute=self.enable_activation_checkpointing)  # fmt: skip
        loss = self._micro.run(step_fn, batch, how)
        if self._plan.micro_batch is not self._micro.choice:  # "auto" halved: the Plan says when and why
            self._plan = dataclasses.replace(self._plan, micro_batch=self._micro.choice)
        return loss

    @property
    def oom_events(self) -> list[OomEvent]:
        """Each out-of-memory ``train_step`` recovered from, oldest first (the step, the sizes, forward or backward)."""
        return list(self._micro.events)

    @property
    def last_snapshot(self) -> Path | None:
        """The memory snapshot the last out-of-memory wrote (CUDA, with ``snapshot_dir`` set), else None."""
        return self._micro.last_snapshot

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` once every ``grad_accum`` calls: unscale, clip, step, free the gradients.

        The gradients are freed (set to None) right after the step on CUDA, and on other devices just before the next
        ``backward`` (the Plan's ``zero_grad`` axis says which, and why). That backward starts every set-up model
        without gradients, as a plain loop's ``zero_grad()`` on each optimizer: a GAN's generator loss leaves none on
        the discriminator for its next step. Returns whether this call reached an optimizer step. With fp16, the
        scaler may still skip a step whose gradients overflowed; that is the normal start of loss scaling.
        """
        if not self._cycle.due(optimizer):
            return False
        clip = self.options.clip_grad_norm
        self.precision.step(optimizer, None if clip is None else partial(self.precision.clip_grad_norm, max_norm=clip))
        self._cycle.stepped(optimizer)
        if self._graphs is not None:
            self._graphs.stepped()
        if self._compile_check is not None:
            self._compile_check.after_step()
        return True

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Clip ``optimizer``'s gradients to ``max_norm``, unscaled first under fp16; return their norm before clipping.

        For a loop that clips or logs the norm itself (``max_norm=float("inf")`` clips nothing): torch's own would clip
        fp16's gradients still scaled. Call it between ``backward`` and ``step``; mid-accumulation it returns None.
        """
        self._cycle.check_set_up(optimizer, "clip_grad_norm_")
        return self.precision.clip_grad_norm(optimizer, max_norm, norm_type) if self._cycle.ends(optimizer) else None

    @property
    def skipped_steps(self) -> int:
        """fp16 optimizer steps the grad scaler skipped on overflow."""
        return self.precision.skipped_steps

    def _check_forms(
        self, planned: Choice[bool], graphs: Choice[bool], model: nn.Module, strategy: str, *, second: bool
    ) -> None:
        """Have the run's first steps confirm a compile the rule chose, CUDA graphs "auto" proposed, and a precision and
        attention kernel no trial or tuned Plan decided (runtime/compile_check.py, runtime/precision_check.py)."""
        compiles = planned.value and self.options.compile == "auto" and self._compile_records
        switch, kernels = (None, None) if self._models else propose_checks(
            self.options, self.facts, self._plan.precision, self._use_precision, model=model, strategy=strategy,
            measured=self._measured, tuned=self._wants_tuned, world_size=self.env.world_size,
            attention=self._plan.attention if self.options.attention == "auto" else None,
        )  # fmt: skip
        if kernels is not None:  # held from the check's choice until pause() or close()
            self._kernels = kernels
            cast(contextlib.ExitStack, self._started).enter_context(kernels.held())
        self._compile_check = check_forms(
            self._compile_check, planned, graphs, model=model, switch=switch, planned_steps=self.planned_steps or 0,
            compiled=self._compile_records[-1] if compiles else None, another_model=second,
            graphed=self._graphs if graphs.value and self.options.cuda_graphs == "auto" else None,
            device=self.device, memory_share=partial(peak_memory_share, self.device), cycle=self._cycle,
        )  # fmt: skip

    def _use_precision(self, name: str) -> None:  # the precision check's switch; the layout "auto" chose follows
        self.precision = Precision(cast(PrecisionName, name), self.device)
        self._layout.follow(name, step=cast(CompileCheck, self._compile_check).steps + 1)

    def __repr__(self) -> str:
        return f"Runtime(device={self.device}, precision={self.precision.name})"
