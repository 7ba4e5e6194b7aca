"""estimate_memory: a training step's peak memory, predicted before the run, activations included.

The step is traced, not guessed from a formula: the Task's own model runs two real training steps
(forward, loss, backward, optimizer step) on fake tensors (memory/trace.py), so any model works and no
device memory is used. The second step is the one measured: by then the optimizer holds its state,
as it does for the rest of the run.

What a CPU trace cannot see of a GPU, and how it is modelled:
- autocast("cuda") does nothing without CUDA, so a GPU's bf16/fp16 autocast is traced with the CPU's
  autocast at the same dtype. Both lists put matmuls, linear layers, convolutions and attention in the low
  precision and losses in fp32; the ops only CUDA's puts in fp32 (pow, exp, log, layer_norm, softmax, sum,
  ...) are run in fp32 by the trace itself (memory/cuda_ops.py). A few ops are low precision only on CUDA
  (einsum, addmv), so an activation that passes through them may be counted at the other width.
- Attention and dropout are traced as CUDA's fused kernels run them (memory/cuda_ops.py, attention.py):
  attention keeps no seq x seq matrix, where a CPU's math path (taken for dropout, say) keeps several, and
  dropout keeps a one-byte mask, where a CPU keeps noise of the input's dtype. A call CUDA runs on its math
  path (no fused kernel takes it, or the run prefers math) keeps its seq x seq weights, in fp32.
- cuBLAS's workspaces, one per thread that runs matmuls (the caller's for the forward, autograd's for the
  backward), are not tensors of the step: the trace notes which threads multiply and ``workspace`` adds
  them (memory/workspace.py).
- The optimizer implementation (fused on CUDA) and the moment gradients are freed (right after the step
  on CUDA, just before the next backward on a CPU, so a CPU step carries them through the forward) come
  from the Runtime's own resolvers for the target device.
- On a CPU, the model's layout (channels_last for bf16 convolutions on AMX) comes from the Runtime's resolver
  for the CPU given, and the copies its pooling backwards make and an LSTM's oneDNN workspace and buffers are
  counted (memory/cpu_ops.py, cpu_lstm.py).
- Sharding (FSDP) and DDP are modelled on the one-process trace: the model states divide by the
  number of ranks under FSDP, plus what it holds whole (the root's own parameters and two of the largest
  block), and the batch is each rank's share.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._pytree import tree_map

from redline.config import boolean, one_of, positive_int
from redline.errors import ConfigError, RedlineError, TrainingError, invalid, wrapping_errors
from redline.hardware.device import CPU_ISAS, CpuIsa, DeviceFacts
from redline.memory.cpu_ops import CpuKernels, cpu_layout, device_facts, to_channels_last
from redline.memory.cuda_ops import CudaOps
from redline.memory.meta import fake_model, model_on_meta
from redline.memory.sample import trace_batch
from redline.memory.states import States, as_run
from redline.memory.trace import LiveBytes, retained_by_module
from redline.memory.workspace import MatmulThreads
from redline.parallel.blocks import find_blocks
from redline.plan import Choice
from redline.plan.attention import AttentionRequest, check_attention
from redline.plan.optimizer import optimizer_facts, resolve_optimizer, resolve_zero_grad
from redline.plan.precision import PRECISIONS
from redline.runtime.attention import prefer_kernel
from redline.runtime.checkpointing import apply_checkpointing
from redline.runtime.contract import split_batch, user_line
from redline.runtime.loss import check_loss
from redline.runtime.optimizer import check_trainable, rebuild_optimizer
from redline.runtime.precision import refuse_half_parameters
from redline.task import OptimizerFactory, Task, require_task

Target = Literal["cuda", "cpu"]
Strategy = Literal["single", "ddp", "fsdp"]

# What fake tensors cannot run (a value read, a shape that depends on values), as against an error of the task's code.
_FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
_TOP_MODULES = 5


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """The predicted peak of one training step on one device (one rank), in bytes, and what makes it up.

    ``params``, ``buffers`` (running statistics, masks, caches), ``gradients`` and ``optimizer_state`` are what
    was alive of each at the peak; ``activations`` is the rest of the peak: tensors saved for backward,
    temporaries and the batch.
    ``total`` adds the CUDA ``workspace`` (cuBLAS's, held beside the tensors) to the traced ``peak``.
    ``top_modules`` lists the modules whose forward left the most memory alive (saved activations and output, a
    block's children included).
    """

    batch_size: int
    precision: str
    target: str
    strategy: str
    world_size: int
    activation_checkpointing: bool
    attention: str = "auto"
    grad_accum: int = 1
    params: int
    buffers: int = 0
    gradients: int
    optimizer_state: int
    activations: int
    workspace: int
    peak: int
    top_modules: tuple[tuple[str, int], ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        """The predicted peak allocated memory, workspace included."""
        return self.peak + self.workspace

    def to_dict(self) -> dict[str, Any]:
        """Return the estimate as JSON-ready data, ``total`` included."""
        data = dataclasses.asdict(self)
        data["top_modules"] = [{"module": name, "bytes": size} for name, size in self.top_modules]
        data["notes"] = list(self.notes)
        return {**data, "total": self.total}


def estimate_memory(
    task: Task,
    *,
    batch_size: int | None = None,
    precision: str = "fp32",
    optimizer: OptimizerFactory | None = None,
    strategy: str = "single",
    world_size: int = 1,
    activation_checkpointing: bool = False,
    target: str = "cuda",
    cpu_isa: CpuIsa | None = None,
    attention: str = "auto",
    grad_accum: int = 1,
) -> MemoryEstimate:
    """Predict the peak memory of one training step of ``task`` on one device of ``target`` ("cuda" or "cpu").

    ``batch_size`` is the global batch (the Task's by default), split over ``world_size`` ranks for
    "ddp" and "fsdp". ``optimizer`` replaces the Task's optimizer factory. On "cuda" the optimizer is
    the fused implementation redline picks there. On "cpu", ``cpu_isa`` is the CPU's instruction set (as
    ``DeviceFacts.cpu_isa``), which decides the layout of a convolutional model (channels_last for bf16 on
    AMX); None takes this machine's, as a Runtime here would (``REDLINE_CPU`` fakes it), and a note says
    which. ``attention`` is the kernel the run prefers, as ``RuntimeOptions.attention``: "auto" traces torch's pick
    per call on the target, a kernel named runs every call it takes and math the rest (math keeps the
    (batch, heads, seq, seq) attention weights for backward). ``grad_accum`` micro-batches of ``batch_size`` each
    make one step: the gradients are held through them all (under FSDP, unsharded, as it holds them until the last
    micro-batch syncs). Nothing is allocated on any device.
    """
    task = require_task(task)
    batch_size = task.batch_size if batch_size is None else batch_size
    positive_int("batch_size", batch_size)
    positive_int("world_size", world_size)
    positive_int("grad_accum", grad_accum)
    boolean("activation_checkpointing", activation_checkpointing)
    if precision == "auto":  # what auto picks depends on a device this function is not given
        raise invalid(
            "precision", precision, f"one of {', '.join(map(repr, PRECISIONS))}",
            "auto is resolved on the device: pass what it picks there ('bf16-mixed' on an Ampere or newer GPU, "
            "'fp16-mixed' on an older one; on a CPU what its trial measured, fp32 or 'bf16-mixed'), or let "
            "redline memory (--gpu NAME for another GPU) resolve it",
        )  # fmt: skip
    one_of("precision", precision, PRECISIONS)
    one_of("strategy", strategy, get_args(Strategy))
    if target == "gpu":  # closest in spelling to 'cpu', but meant 'cuda'
        raise invalid(
            "target", target, "'cuda' or 'cpu'", "did you mean target='cuda'? (any GPU, AMD's under ROCm too)"
        )
    one_of("target", target, get_args(Target))
    if cpu_isa is not None:
        one_of("cpu_isa", cpu_isa, CPU_ISAS)
    one_of("attention", attention, get_args(AttentionRequest))
    if target == "cpu":
        check_attention(attention, DeviceFacts(type="cpu", name="a CPU"))
    if strategy == "single" and world_size > 1:
        raise invalid("world_size", world_size, "1 with strategy='single'", "use strategy='ddp' or 'fsdp'")
    if optimizer is not None and (isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer)):
        # an optimizer built on other parameters would be called on the traced model's and fail mid-trace
        shown = f"<{type(optimizer).__name__}>" if isinstance(optimizer, torch.optim.Optimizer) else repr(optimizer)
        raise ConfigError(
            f"optimizer={shown} is not allowed; expected a factory params -> Optimizer\n"
            "hint: write optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
        )
    local_batch = math.ceil(batch_size / world_size)
    trace = trace_step(
        task,
        batch_size=local_batch,
        precision=precision,
        optimizer=optimizer or task.optimizer,
        activation_checkpointing=activation_checkpointing,
        device=device_facts(target, cpu_isa),
        attention=attention,
    )
    sparse = trace.pop("sparse_gradients")
    layout = trace.pop("channels_last")
    casts = trace.pop("parameter_casts")  # autocast's copies of the parameters, among the activations
    sampled = trace.pop("sampled")  # which items the traced batch holds, where not simply the first ones
    # The model's structure (parameter sizes, blocks), built once and only when asked about.
    structure = meta_model(task) if strategy != "single" or grad_accum > 1 else None
    estimate = MemoryEstimate(
        batch_size=batch_size,
        precision=precision,
        target=target,
        strategy=strategy,
        world_size=world_size,
        activation_checkpointing=activation_checkpointing,
        attention=attention,
        grad_accum=grad_accum,
        notes=_notes(precision, target, strategy, sparse, layout, grad_accum)
        + _uneven(batch_size, world_size, local_batch)
        + sampled,
        **trace,
    )
    traced = States(estimate.params, estimate.gradients, estimate.optimizer_state, estimate.activations, estimate.peak)
    held = as_run(traced, structure, strategy, world_size, precision, grad_accum, casts)
    return dataclasses.replace(estimate, **dataclasses.asdict(held))


@torch.inference_mode(False)  # a training step needs autograd, whatever the caller's mode
@torch.enable_grad()
def trace_step(
    task: Task,
    *,
    batch_size: int,
    precision: str,
    optimizer: OptimizerFactory,
    activation_checkpointing: bool,
    device: DeviceFacts,
    attention: str = "auto",
) -> dict[str, Any]:
    """Run two training steps of ``task`` on fake tensors, as the Runtime would run them on ``device`` (its
    optimizer implementation, its moment to free gradients, on a CPU its layout and the copies its kernels make,
    on CUDA its kernels and autocast, and the ``attention`` kernel it prefers); return the second step's peak and
    its parts, the workspaces the device holds beside them, the layout chosen (``channels_last``) and a note on the
    items traced where they are the largest found (memory/sample.py)."""
    grads_through_forward = resolve_zero_grad(device).value == "before backward"
    tracker = LiveBytes()
    threads = MatmulThreads()
    cuda = device.type == "cuda"
    # a real tensor the model's code reads (a module-level constant, MASK.to(x.device)) is faked where an op meets
    # it; the model's own tensors are faked before the trace (_fake_model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    sample, rows, sampled = trace_batch(task.train_data, batch_size, task.collate_fn)
    autocast = _AUTOCAST.get(precision)
    with _tracing(task):  # the user's module copied onto meta (it stays as it was), or the factory's built there
        built = model_on_meta(task)
    # a lazy module's parameters have no shape to fake, and a model with nothing to train gives the optimizer an
    # "empty parameter list": refused with the errors a run gives
    check_trainable(built)
    with mode, tracker, _device_kernels(device, threads, attention), _tracing(task):
        model = fake_model(built, mode)
        layout = cpu_layout(model, precision, device)
        if layout.value:
            to_channels_last(model)
        for tensor in [*model.parameters(), *model.buffers()]:
            tracker.track(tensor)
        tracker.cast_from = {tracker.track(p) for p in model.parameters()}  # to tell autocast's copies of them
        if activation_checkpointing:
            _checkpoint_blocks(model, cuda, attention)
        model.train()
        opt = optimizer(model.parameters())
        if precision in ("fp16-mixed", "bf16-mixed"):  # a .half() model: refused as the run refuses it
            refuse_half_parameters(opt, precision)
        if resolve_optimizer(optimizer_facts(opt, model, device=device), device).value == "fused":
            opt = rebuild_optimizer(opt, fused=True)
        faked = tree_map(_faked(mode, tracker, rows, batch_size, layout.value), sample)
        inputs, targets = split_batch(faked, "train_data")
        grad_keys: set[int] = set()
        step = _stepper(task, model, opt, autocast, grads_through_forward, tracker, grad_keys, threads)
        step(inputs, targets)
        tracker.reset_peak()
        with retained_by_module(model, tracker) as retained:
            step(inputs, targets)
        params = tracker.bytes_at_peak(tracker.track(p) for p in model.parameters())
        buffers = tracker.bytes_at_peak(tracker.track(b) for b in model.buffers())
        grads = tracker.bytes_at_peak(grad_keys)
        states = [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        opt_state = tracker.bytes_at_peak(tracker.track(t) for t in states)
        peak = tracker.peak
        casts = tracker.bytes_at_peak(tracker.casts)
        sparse = any(isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse for m in model.modules())
    top = sorted(retained.items(), key=lambda item: item[1], reverse=True)[:_TOP_MODULES]
    return {
        "params": params,
        "buffers": buffers,
        "gradients": grads,
        "optimizer_state": opt_state,
        "activations": peak - params - buffers - grads - opt_state,
        "peak": peak,
        "workspace": threads.workspace if cuda else 0,
        "top_modules": tuple(top),
        "sparse_gradients": sparse,
        "channels_last": layout,
        "parameter_casts": casts,
        "sampled": sampled,
    }


@wrapping_errors
def _tracing(task: Task) -> Iterator[None]:
    """Turn an error of the Task's own code on fake tensors into a TrainingError that names the way out."""
    # torch logs an op that fails on fake tensors with its whole traceback before raising; the error
    # below says it once, with the task's own line and the fix
    torch_log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, torch_log.disabled = torch_log.disabled, True
    try:
        yield
    except RedlineError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        measure = "find the largest batch by running it on the device instead: redline memory --measure"
        if "overflow" in first.lower():  # a size past int64: a batch size with zeros too many, or a layer's
            hint = "a tensor of this size cannot exist (more than 2**63 elements or bytes): pass a smaller batch size, "
            hint += "or check the sizes of the model's layers"
        elif isinstance(exc, _FAKE_LIMITS):
            hint = "fake tensors hold no values, so code that reads them (.item(), .tolist(), nonzero, a branch on a "
            hint += f"value) cannot be traced; {measure} (redline.find_batch_size)"
        else:  # as likely a bug in the task's code, which a real step would meet too
            hint = "if the line shown is a bug, fix it (`redline train --max-steps 1` runs one real step); if it "
            hint += f"reads a tensor's values (.item(), .numpy(), a branch on a value), fake tensors cannot: {measure}"
        raise TrainingError(
            f"task {task.name!r}: a training step could not be traced on fake tensors: {type(exc).__name__}: "
            f"{first}{user_line(exc)}\nhint: {hint}"
        ) from exc
    finally:
        torch_log.disabled = disabled


def _stepper(
    task: Task,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    dtype: torch.dtype | None,
    grads_through_forward: bool,
    tracker: LiveBytes,
    grad_keys: set[int],
    threads: MatmulThreads,
) -> Callable[[Any, Any], None]:
    """One training step as the Runtime runs it, gradients freed when it frees them; ``grad_keys`` gathers
    the gradients' storages while they exist, ``threads`` notes the backward's matmuls as autograd's thread's."""

    def step(inputs: Any, targets: Any) -> None:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = check_loss(task.loss_fn(model(inputs), targets), training=True)
        if grads_through_forward:
            opt.zero_grad(set_to_none=True)  # the CPU frees them just before the next backward
        with threads.on_autograd_thread():
            loss.backward()
        del loss
        grad_keys.update(tracker.track(p.grad) for p in model.parameters() if p.grad is not None)
        try:
            opt.step()
        except _FAKE_LIMITS as exc:  # the optimizer's own code reads a value (Adafactor: its step count, norms)
            raise _unread_optimizer(task, opt, exc) from exc
        if not grads_through_forward:
            opt.zero_grad(set_to_none=True)  # CUDA frees them right after the step

    return step


def _unread_optimizer(task: Task, opt: torch.optim.Optimizer, exc: Exception) -> TrainingError:
    """The error for an optimizer whose step reads a tensor's value, which fake tensors do not hold: the optimizer
    named as the cause, where the trace's general hint would send the user looking for an .item() of their own."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    name = type(opt).__name__
    return TrainingError(
        f"task {task.name!r}: the optimizer's step could not be traced on fake tensors: {name}.step reads a "
        f"tensor's value ({type(exc).__name__}: {first}), which fake tensors do not hold{user_line(exc)}\n"
        "hint: find the largest batch by running training steps on the device instead: redline memory --measure "
        f"(redline.find_batch_size); the estimate traces optimizers that only compute on tensors (AdamW, SGD), "
        f"not {name}"
    )


def _faked(mode: FakeTensorMode, tracker: LiveBytes, rows: int, size: int, channels_last: bool) -> Callable[[Any], Any]:
    """Fake a leaf of a batch of ``rows``; a tensor of one item becomes the batch's ``size`` rows (collate stacks
    items along a new first axis). With ``channels_last`` an image (a 4-d floating tensor) is laid out NHWC, as
    the Runtime moves it (runtime/transfer.py)."""

    def fake(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        out: torch.Tensor = mode.from_tensor(leaf)
        nhwc = channels_last and out.dim() == 4 and out.is_floating_point()
        layout = torch.channels_last if nhwc else torch.contiguous_format
        if rows < size:  # an op under the tracker: counted as it is made
            return torch.empty((size, *out.shape[1:]), dtype=out.dtype, memory_format=layout)
        out = out.contiguous(memory_format=layout) if nhwc else out
        tracker.track(out)
        return out

    return fake


def _checkpoint_blocks(model: nn.Module, cuda: bool, attention: str) -> None:
    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(
            "activation_checkpointing=True, but the model has no repeated blocks to recompute\n"
            "hint: leave it off, or wrap your own layers with torch.utils.checkpoint"
        )
    if cuda:  # a recomputation runs in backward, where torch enters no torch-function mode: each block enters CudaOps
        for _, block in blocks:
            block.forward = functools.partial(_as_on_cuda, attention, block.forward)
    apply_checkpointing(model, blocks)


@contextmanager
def _device_kernels(device: DeviceFacts, threads: MatmulThreads, attention: str) -> Iterator[None]:
    """For a CUDA step, run the ops CUDA runs its own way as CUDA does (attention on ``attention``'s kernel) and
    note the threads that multiply; for a CPU step, count what the CPU's kernels make beside their outputs
    (memory/cpu_ops.py), its attention on the kernel preferred as a run prefers it. Entered above the tracker."""
    if device.type != "cuda":
        with CpuKernels(device.cpu_isa), prefer_kernel(attention) if attention != "auto" else nullcontext():
            yield
        return
    with threads, CudaOps(attention), warnings.catch_warnings():
        # the math path is traced with the dropout mask CUDA keeps given to it, which torch says is for tests; the
        # warning reaches Python when the call that entered the mode returns, so it is filtered around the step
        warnings.filterwarnings("ignore", message="Dropout mask should only be used for testing")
        yield


def _as_on_cuda(attention: str, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with CudaOps(attention):
        return forward(*args, **kwargs)


def _notes(
    precision: str, target: str, strategy: str, sparse: bool, layout: Choice[bool], grad_accum: int
) -> tuple[str, ...]:
    notes = ["eager model: torch.compile fuses ops and usually saves activation memory"]
    if layout.value:  # the layout changes what the CPU's kernels copy; the CPU it was chosen for is said
        notes.append(f"traced channels_last (NHWC), {layout.reason}")
    if sparse:  # a sparse gradient's size is its number of rows looked up: a value fake tensors do not hold
        notes.append("sparse embedding gradients are counted empty: they hold a row per index looked up in the batch")
    if target == "cuda" and precision != "fp32":
        notes.append(f"{precision} traced with the CPU's autocast lists, which differ from CUDA's in a few ops")
    if target == "cuda":
        notes.append(
            "workspace is cuBLAS's, one per thread that multiplies matrices (hipBLAS's on ROCm); cuDNN's per-call "
            "convolution workspace, the CUDA context and the allocator's cache come on top of the total"
        )
    if strategy != "single":
        notes.append(f"{strategy} modelled from one process's trace")
    if grad_accum > 1:
        held = " (unsharded, until the last one syncs them)" if strategy == "fsdp" else ""
        notes.append(f"each step accumulates {grad_accum} micro-batches: the gradients are held through them{held}")
    return tuple(notes)


def _uneven(batch_size: int, world_size: int, local_batch: int) -> tuple[str, ...]:
    """A note where the ranks' batches add up to more than ``batch_size``: each rank was traced with its share
    rounded up (at least one sample), which the batch size alone would not say."""
    if local_batch * world_size == batch_size:
        return ()
    traced = local_batch * world_size
    return (f"batch {batch_size} over {world_size} ranks: each rank is weighed with {local_batch} "
            f"sample{'s' if local_batch > 1 else ''} ({traced:,} in all), its share rounded up",)  # fmt: skip


def meta_model(task: Task) -> nn.Module:
    """The Task's model for looking at its structure: the given module, or the factory's on the meta device."""
    return task.model if isinstance(task.model, nn.Module) else model_on_meta(task)
