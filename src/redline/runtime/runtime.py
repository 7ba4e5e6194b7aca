"""Runtime: keep your own training loop, and run it as fast as this machine allows.

rt = Runtime()
model, optimizer = rt.setup(model, optimizer)
for inputs, targets in rt.setup_loader(loader):
    with rt.autocast():
        loss = loss_fn(model(inputs), targets)
    rt.backward(loss)
    rt.step(optimizer)
print(rt.explain())
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from redline.errors import ConfigError, invalid
from redline.hardware.device import DeviceFacts, probe_accelerators, probe_device
from redline.parallel.env import init_process_group, read_env
from redline.parallel.strategies import gradient_sync, unwrap, wrap_ddp
from redline.plan import Choice, Plan
from redline.plan.compile import resolve_compile
from redline.plan.device import resolve_device
from redline.plan.layout import resolve_channels_last
from redline.plan.loader import resolve_loader
from redline.plan.optimizer import optimizer_facts, resolve_optimizer, resolve_zero_grad
from redline.plan.precision import Precision, resolve_precision, resolve_tf32
from redline.plan.strategy import resolve_strategy
from redline.runtime.compile import CompileRecord, compile_module, compile_supported
from redline.runtime.loading import DeviceLoader, loader_facts, rebuild_dataloader
from redline.runtime.optimizer import OptimizerLike, build_optimizer, rebuild_optimizer, shard_with_optimizer
from redline.runtime.sampling import EpochSampler, GlobalBatchSampler, split_caveats
from redline.runtime.seed import seed_everything
from redline.runtime.transfer import move_to

_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
_NOTHING = contextlib.nullcontext()


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """The Runtime's requested options, as one value tools pass around and store."""

    devices: str = "auto"
    precision: str = "auto"
    compile: str | bool = "auto"
    channels_last: str | bool = "auto"
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    seed: int | None = None
    strategy: str = "auto"

    @classmethod
    def from_plan(
        cls, plan: Mapping[str, Mapping[str, Any]], *, seed: int | None = None, strategy: str = "auto"
    ) -> RuntimeOptions:
        """Return options that reproduce a stored Plan's resolved choices (``Plan.to_dict()``).

        The strategy is not taken from the Plan: it follows the number of processes, which may
        differ in the resumed run.
        """

        def switch(axis: str) -> str:
            return "on" if plan.get(axis, {}).get("value") else "off"

        return cls(
            devices=str(plan["device"]["value"]),
            precision=str(plan["precision"]["value"]),
            compile=switch("compile"),
            channels_last=switch("channels_last"),
            grad_accum=int(plan["grad_accum"]["value"]),
            clip_grad_norm=plan["clip_grad_norm"]["value"],
            seed=seed,
            strategy=strategy,
        )

    def runtime(self, *, planned_steps: int | None = None) -> Runtime:
        """Build the Runtime these options describe."""
        return Runtime(**dataclasses.asdict(self), planned_steps=planned_steps)


class Runtime:
    """Accelerate a plain PyTorch loop: device, precision, compile, layout, optimizer and loading.

    Every "auto" is resolved into a ``Plan`` whose choices carry their reasons (``explain()``).
    ``planned_steps`` tells the compile decision how long the run is; without it, "auto" does not
    compile, since a compile that never repays itself would make the run slower.
    """

    def __init__(
        self,
        devices: str = "auto",
        precision: str = "auto",
        compile: str | bool = "auto",
        channels_last: str | bool = "auto",
        grad_accum: int = 1,
        clip_grad_norm: float | None = None,
        seed: int | None = None,
        strategy: str = "auto",
        *,
        planned_steps: int | None = None,
    ) -> None:
        if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
            raise invalid("grad_accum", grad_accum, "a positive integer (micro-batches per optimizer step)")
        if clip_grad_norm is not None and not (isinstance(clip_grad_norm, int | float) and clip_grad_norm > 0):
            raise invalid("clip_grad_norm", clip_grad_norm, "None or a positive number")
        if planned_steps is not None and (not isinstance(planned_steps, int) or planned_steps < 1):
            raise invalid("planned_steps", planned_steps, "None or a positive integer")
        if seed is not None:
            seed_everything(seed)
        self._requested = {"compile": compile, "channels_last": channels_last, "strategy": strategy}
        self.planned_steps = planned_steps
        self.seed = seed
        self.env = read_env()
        device = resolve_device(devices, probe_accelerators())
        if self.env.distributed and device.value.startswith("cuda"):  # one GPU per worker
            device = Choice(f"cuda:{self.env.local_rank}", f"{device.reason}; worker {self.env.local_rank}'s GPU")
        self.device = torch.device(device.value)
        self._owns_group = init_process_group(self.env, self.device.type)
        if self._owns_group and self.device.type == "cpu":  # gloo: leave the group at exit if the script does not
            atexit.register(self.close)
        self.facts: DeviceFacts = probe_device(self.device)
        chosen = resolve_precision(precision, self.facts)
        self.precision: Precision = chosen.value
        tf32 = resolve_tf32(self.facts)
        if tf32.value:  # process-wide, as torch's settings are
            torch.set_float32_matmul_precision("high")
            torch.backends.cudnn.allow_tf32 = True
        self.grad_accum = grad_accum
        self.clip_grad_norm = clip_grad_norm
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16-mixed" else None
        zero_grad = resolve_zero_grad(self.facts)
        self._zero_after_step = zero_grad.value == "after step"
        self._pending_zero: dict[int, torch.optim.Optimizer] = {}
        self._plan = Plan(
            zero_grad=zero_grad,
            device=Choice(device.value, f"{device.reason} ({self.facts.name})"),
            precision=chosen,
            tf32=tf32,
            grad_accum=Choice(grad_accum, "requested" if grad_accum > 1 else "default: a step per batch"),
            clip_grad_norm=Choice(clip_grad_norm, "requested" if clip_grad_norm else "default: no clipping"),
        )
        self._compile_records: list[CompileRecord] = []
        self._wrapped: nn.Module | None = None  # the DDP/FSDP module whose gradient sync backward controls
        self._backwards = 0
        self._micro_steps: dict[int, int] = {}
        self._skipped: torch.Tensor | None = None  # fp16 steps the scaler skipped, counted on the device
        self._split_caveats: list[str] = []  # the model's layers that depend on how the batch is split

    # -- setup ---------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: OptimizerLike) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Place ``model`` on the device, build or rebuild the optimizer, and compile if planned.

        ``optimizer`` is an instance built on ``model``'s parameters, or a factory params -> Optimizer.
        The model is changed in place and returned; keep using the returned optimizer.
        """
        if not isinstance(model, nn.Module):
            raise invalid("model", type(model).__name__, "a torch.nn.Module")
        has_conv2d = any(isinstance(m, nn.Conv2d) for m in model.modules())
        self._split_caveats = split_caveats(model)
        layout = resolve_channels_last(
            self._requested["channels_last"], self.facts, has_conv2d=has_conv2d, precision=self.precision
        )
        model.to(self.device)
        if layout.value:
            model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        strategy = resolve_strategy(
            str(self._requested["strategy"]),
            world_size=self.env.world_size,
            params=sum(p.numel() for p in model.parameters()),
            device_mem_gib=self.facts.mem_gib,
        )
        if strategy.value != "single" and not torch.distributed.is_initialized():
            raise ConfigError(
                f"strategy={strategy.value!r} needs a process group, and this process was not launched as a "
                "worker\nhint: start it with `redline launch` (or `redline train --nproc N`), or use strategy='auto'"
            )
        if strategy.value == "ddp":
            model = wrap_ddp(model, self.device)
            self._wrapped = model
            built = build_optimizer(optimizer, unwrap(model))
        elif strategy.value == "fsdp":  # fully_shard replaces the parameters: the optimizer is rebuilt on them
            model, built = shard_with_optimizer(model, build_optimizer(optimizer, model), precision=self.precision)
            self._wrapped = model
        else:
            built = build_optimizer(optimizer, model)
        facts = optimizer_facts(built)
        if facts.has_state:  # loading its own state casts the moments onto the parameters' device
            built.load_state_dict(built.state_dict())
        impl = resolve_optimizer(facts, self.facts)
        if impl.value == "fused" and strategy.value == "fsdp":
            impl = Choice("as given", f"{facts.name} on FSDP2's sharded (DTensor) parameters: torch's default")
        if impl.value == "fused":
            built = rebuild_optimizer(built, fused=True)
        planned = resolve_compile(
            self._requested["compile"],
            self.facts,
            planned_steps=self.planned_steps,
            supported=lambda: compile_supported(self.device.type),
        )
        if planned.value:
            self._compile_records.append(compile_module(model))
        self._plan = dataclasses.replace(
            self._plan, strategy=strategy, channels_last=layout, compile=planned, optimizer=impl
        )
        return model, built

    def setup_loader(self, loader: Iterable[Any], *, local_devices: int = 1) -> DeviceLoader:
        """Return ``loader`` tuned for the device, yielding batches already on it."""
        chosen = resolve_loader(loader_facts(loader, local_devices), self.facts)
        batches = self._global_batches(loader)
        if isinstance(loader, DataLoader) and (chosen.value.rebuild or batches is not None):
            loader = rebuild_dataloader(loader, chosen.value, batch_sampler=batches)
        if isinstance(loader, DataLoader) and isinstance(loader.batch_sampler, GlobalBatchSampler):
            split = loader.batch_sampler
            reason = f"{chosen.reason}; global batch {split.global_batch} = {split.world_size} x {split.local_batch}"
            reason = "; ".join([reason, *self._split_caveats])
            chosen = Choice(chosen.value, reason)
        self._plan = dataclasses.replace(self._plan, loader=chosen)
        channels_last = self._plan.channels_last is not None and self._plan.channels_last.value
        return DeviceLoader(loader, self.device, channels_last=channels_last)

    def _global_batches(self, loader: Iterable[Any]) -> GlobalBatchSampler | None:
        """Under several processes, a batch sampler that gives this rank its share of each global batch."""
        if not self.env.distributed or not isinstance(loader, DataLoader) or loader.batch_size is None:
            return None  # one process, an iterable of batches, or the user's own batch sampler
        if isinstance(loader.dataset, IterableDataset) or isinstance(loader.batch_sampler, GlobalBatchSampler):
            return None  # an iterable dataset shards itself; the Trainer's loader is split already
        order = EpochSampler(
            len(loader.dataset),  # type: ignore[arg-type]
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=self.seed or 0,  # the same order on every rank
            auto_epoch=True,
        )
        return GlobalBatchSampler(
            order, global_batch=loader.batch_size, rank=self.env.rank, world_size=self.env.world_size
        )

    def to_device(self, batch: Any) -> Any:
        """Move a nested batch (tensors in tuples, lists, dicts, dataclasses) to the device."""
        channels_last = self._plan.channels_last is not None and self._plan.channels_last.value
        return move_to(batch, self.device, non_blocking=self.device.type == "cuda", channels_last=channels_last)

    # -- the loop ------------------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Return the context that runs the forward pass in the planned precision."""
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return _NOTHING  # reusable: the fp32 loop pays for no new object per step
        return torch.autocast(self.device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss``, divided over the accumulated micro-batches and scaled for fp16."""
        if self._pending_zero:  # the last step's gradients, freed as late as the plain loop frees them
            for optimizer in self._pending_zero.values():
                optimizer.zero_grad(set_to_none=True)
            self._pending_zero.clear()
        self._backwards += 1
        sync = self._backwards % self.grad_accum == 0  # all-reduce gradients on the last micro-batch only
        if self.grad_accum > 1:
            loss = loss / self.grad_accum
        with gradient_sync(self._wrapped, sync) if self._wrapped is not None else _NOTHING:
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` once every ``grad_accum`` calls: unscale, clip, step, free the gradients.

        The gradients are freed (set to None) right after the step on CUDA, and on other devices
        just before the next ``backward`` (the Plan's ``zero_grad`` axis says which, and why).
        Returns whether this call reached an optimizer step. With fp16, the scaler may still skip a
        step whose gradients overflowed; that is the normal start of loss scaling.
        """
        key = id(optimizer)
        if self.grad_accum > 1:
            count = self._micro_steps.get(key, 0) + 1
            if count < self.grad_accum:
                self._micro_steps[key] = count
                return False
            self._micro_steps[key] = 0
        if self.scaler is not None:
            if self.clip_grad_norm is not None:
                self.scaler.unscale_(optimizer)
                self._clip(optimizer)
            scale = self.scaler._scale  # the scale only drops when a step's gradients overflowed
            before = scale.clone() if scale is not None else None
            self.scaler.step(optimizer)
            self.scaler.update()
            if before is not None and self.scaler._scale is not None:
                dropped = (self.scaler._scale < before).int()
                self._skipped = dropped if self._skipped is None else self._skipped + dropped
        else:
            if self.clip_grad_norm is not None:
                self._clip(optimizer)
            optimizer.step()
        if self._zero_after_step:
            optimizer.zero_grad(set_to_none=True)
        else:
            self._pending_zero[key] = optimizer
        return True

    def _clip(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)  # type: ignore[arg-type]

    @property
    def skipped_steps(self) -> int:
        """fp16 optimizer steps the grad scaler skipped on overflow (reading it syncs the device)."""
        return int(self._skipped.item()) if self._skipped is not None else 0

    @property
    def sharded(self) -> bool:
        """Whether setup sharded the model with FSDP2 (its state is then saved and loaded per rank)."""
        return self._plan.strategy is not None and self._plan.strategy.value == "fsdp"

    # -- explaining ----------------------------------------------------------------------------

    @property
    def compile_seconds(self) -> float | None:
        """Seconds the compiled models' first calls took (the compile time), once they have run."""
        seconds = [r.seconds for r in self._compile_records if r.seconds is not None]
        return sum(seconds) if seconds else None

    def explain(self) -> Plan:
        """Return the resolved Plan: each axis with its value and the reason for it."""
        plan = self._plan
        fell_back = [r.fell_back for r in self._compile_records if r.fell_back]
        if plan.compile is not None and fell_back:
            plan = dataclasses.replace(plan, compile=Choice(False, f"compile failed, ran eagerly: {fell_back[0]}"))
        elif plan.compile is not None and plan.compile.value and self.compile_seconds is not None:
            reason = f"{plan.compile.reason}; compiled in {self.compile_seconds:.1f} s"
            plan = dataclasses.replace(plan, compile=Choice(True, reason))
        return plan

    def adopt_reasons(self, stored: Mapping[str, Mapping[str, Any]], note: str) -> None:
        """Carry a stored Plan's reasons over to the axes whose values it fixed (a resumed run)."""
        changes = {}
        for axis, current in self._plan.to_dict().items():
            old = stored.get(axis)
            if old is not None and old.get("value") == current["value"]:
                changes[axis] = Choice(getattr(self._plan, axis).value, f"{note}: {old.get('reason', '')}")
        self._plan = dataclasses.replace(self._plan, **changes)

    def close(self) -> None:
        """Leave the process group this Runtime joined (call once, at the end of a launched script).

        On the CPU (gloo) it is also called at interpreter exit, for scripts that do not.

        Collecting garbage first matters on gloo: an FSDP model freed by the interpreter's final
        collection, after gloo's threads lost the GIL, aborted the process in about 5% of CPU runs.
        """
        if self._owns_group and torch.distributed.is_initialized():
            gc.collect()
            torch.distributed.destroy_process_group()
            self._owns_group = False

    def __repr__(self) -> str:
        return f"Runtime(device={self.device}, precision={self.precision})"
