"""The Runtime's options: one validated value that tools pass around, store, and turn into flags."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from redline.config import boolean, one_of, option, positive_int, positive_number, seed_number, with_changes
from redline.errors import invalid
from redline.plan.attention import AttentionRequest
from redline.plan.device import check_devices
from redline.plan.micro_batch import MicroBatch, check_micro_batch

Switch = Literal["auto", "on", "off"]
PrecisionRequest = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed"]
StrategyRequest = Literal["auto", "single", "ddp", "fsdp"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune"]  # torch.compile's modes
SWITCHES: tuple[str, ...] = get_args(Switch)
# The fields whose default is a value, not "auto": None leaves one out, read as this value, and a tuned Plan may set it
# where a value given, the default's too, wins (``--grad-accum 1`` over a tune's micro-batches).
LEFT_OUT = {"grad_accum": 1, "compile_mode": "default"}


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """What a run asks of the Runtime; every "auto" is resolved into the Plan when the Runtime is built.

    ``compile``, ``cuda_graphs``, ``channels_last`` and ``activation_checkpointing`` also take True/False, kept as
    "on"/"off".
    """

    devices: str = option("auto", "auto, cpu, cuda, cuda:N or mps.")
    precision: PrecisionRequest = option("auto", "auto, fp32, bf16-mixed or fp16-mixed.")
    compile: Switch = option("auto", "torch.compile: auto, on or off.")
    compile_mode: CompileMode = option(
        None, "torch.compile mode: default (when left out), reduce-overhead (CUDA graphs) or max-autotune."
    )
    cuda_graphs: Switch = option(
        "auto",
        "CUDA graphs for the training forward and backward: auto (on CUDA, kept if the first steps run faster), on or "
        "off.",
    )
    channels_last: Switch = option("auto", "channels_last memory layout: auto, on or off.")
    attention: AttentionRequest = option(
        "auto",
        "scaled_dot_product_attention's kernel: auto (torch picks per call), flash, efficient, cudnn or math; a kernel "
        "named runs every call it takes, math the rest.",
    )
    loader_workers: int | None = option(None, "DataLoader worker processes (default: chosen for the device).")
    grad_accum: int = option(None, "Micro-batches per optimizer step; 1 when left out.", min=1)
    micro_batch: MicroBatch = option(
        None, "Split each batch into micro-batches of N samples, or auto: halve on out-of-memory and redo the batch."
    )
    clip_grad_norm: float | None = option(None, "Clip the gradient norm to this value.")
    seed: int | None = option(None, "Seed every RNG and the data order (default 0 for the order).")
    strategy: StrategyRequest = option("auto", "auto, single, ddp or fsdp (with several processes).")
    deterministic: bool = option(False, "torch.use_deterministic_algorithms(True) while the run lasts.")
    find_unused_parameters: bool = option(
        False,
        "DDP: let a step leave parameters without a gradient (a model whose branches differ from step to step); "
        "costs a walk of the autograd graph each step.",
    )
    activation_checkpointing: Switch = option(
        "auto", "Recompute the repeated blocks' activations in backward: auto (when memory runs short), on or off."
    )
    # Which of LEFT_OUT's fields were left out (None), as their defaults now read: dataclasses.replace passes it on,
    # so options built from these keep them left out unless given another value (``build``: any value). Set by
    # __post_init__ and ``build``, not by hand.
    left_out: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False, metadata={"internal": True})

    def __post_init__(self) -> None:
        left = set(self.left_out)
        for name, default in LEFT_OUT.items():
            if getattr(self, name) is None:
                left.add(name)
                object.__setattr__(self, name, default)
            elif getattr(self, name) != default:
                left.discard(name)
        object.__setattr__(self, "left_out", tuple(sorted(left)))  # sorted: the ranks compare its repr
        for name in ("compile", "cuda_graphs", "channels_last", "activation_checkpointing"):
            value = getattr(self, name)
            if isinstance(value, bool):
                object.__setattr__(self, name, "on" if value else "off")
            one_of(name, getattr(self, name), SWITCHES)
        check_devices(self.devices)
        one_of("precision", self.precision, get_args(PrecisionRequest))
        one_of("strategy", self.strategy, get_args(StrategyRequest))
        one_of("compile_mode", self.compile_mode, get_args(CompileMode))
        if self.compile == "off" and self.compile_mode != "default":
            raise invalid(
                "compile_mode", self.compile_mode, "'default' when compile is off (a mode is how a compiled step runs)",
                f"pass compile='on' to compile in {self.compile_mode}, or compile_mode='default' for an "
                "eager step; for CUDA graphs without a compile, cuda_graphs='on'",
            )  # fmt: skip
        one_of("attention", self.attention, get_args(AttentionRequest))
        if self.loader_workers is not None and (
            isinstance(self.loader_workers, bool) or not isinstance(self.loader_workers, int) or self.loader_workers < 0
        ):
            raise invalid("loader_workers", self.loader_workers, "a whole number of worker processes (0 or more)")
        positive_int("grad_accum", self.grad_accum)
        object.__setattr__(self, "micro_batch", check_micro_batch(self.micro_batch))
        positive_number("clip_grad_norm", self.clip_grad_norm, optional=True)
        seed_number("seed", self.seed, optional=True)
        boolean("deterministic", self.deterministic)
        boolean("find_unused_parameters", self.find_unused_parameters)

    def given(self, name: str) -> bool:
        """Whether option ``name`` was asked for: set to another value than its default, or, for LEFT_OUT's, given at
        all (``grad_accum=1``); a tuned Plan sets the options not given."""
        if name in LEFT_OUT:
            return name not in self.left_out
        return bool(getattr(self, name) != _DEFAULTS[name])

    @classmethod
    def build(cls, options: RuntimeOptions | None = None, **changes: Any) -> RuntimeOptions:
        """Return ``options`` (or the defaults) with ``changes``; an unknown name is a clear error. A LEFT_OUT field
        changed to a value, its default's too, is given (``Runtime(options, grad_accum=1)`` wins over a tune)."""
        built = with_changes(cls, options, changes, what="a Runtime option")
        named = {name for name in LEFT_OUT if changes.get(name) is not None}
        if not named & set(built.left_out):
            return built
        return dataclasses.replace(built, left_out=tuple(sorted(set(built.left_out) - named)))

    def with_plan(self, plan: Mapping[str, Mapping[str, Any]]) -> RuntimeOptions:
        """Return these options with the axes a stored Plan fixed (``Plan.to_dict()``), for a resumed run.

        Precision, compile, layout (auto's stays auto), the attention kernel, accumulation, clipping and the seed (it
        fixes the data order, and a resumed epoch goes on in its order) come from the Plan, so the run goes on as it
        started; the device too unless one is asked for now (a run may move to a GPU). The strategy (it follows the
        number of processes, which may differ now), determinism and the micro-batches (a run that ran
        out of memory is resumed with --micro-batch auto) stay as asked for now. Activation
        checkpointing left to "auto" stays on if the Plan had it on.
        """

        def switch(axis: str) -> Switch:
            return "on" if plan.get(axis, {}).get("value") else "off"

        # A layout auto chose stays auto: in the Plan's precision the rule lays the model out as it did, and auto's
        # own ways go on (the check and its NCHW fallback, NHWC kept inside the model: "on" gives NHWC outputs)
        layout = stored_reason(plan.get("channels_last", {}).get("reason", ""))
        chosen = layout.startswith("auto") or LAID_OUT_BY_AUTO in layout  # a tuned NHWC that went through auto
        channels_last = "auto" if chosen else switch("channels_last")

        # Recomputing changes memory, not results: "on" or "off" asked now wins (a run that ran out of
        # memory resumes with it on). "auto" keeps a stored "on"; stored off, it starts off as it did.
        checkpointing = self.activation_checkpointing
        if checkpointing == "auto" and plan.get("activation_checkpointing", {}).get("value") is True:
            checkpointing = "on"

        # A mode says how a compile runs: a run that ran eager goes on without one. Its CUDA graphs left to auto stay
        # as it ran them (a reduce-overhead mode kept them off: graphs are then the compile's).
        mode = self.compile_mode if switch("compile") == "on" else "default"
        graphs = self.cuda_graphs
        if mode != self.compile_mode and graphs == "auto" and plan.get("cuda_graphs", {}).get("value") is False:
            graphs = "off"
        return dataclasses.replace(  # the stored Plan's values, not the user's: left out stays left out
            self,
            devices=str(plan["device"]["value"]) if self.devices == "auto" else self.devices,
            precision=plan["precision"]["value"],
            compile=switch("compile"),
            compile_mode=mode,
            cuda_graphs=graphs,
            channels_last=channels_last,
            grad_accum=int(plan["grad_accum"]["value"]),
            clip_grad_norm=plan["clip_grad_norm"]["value"],
            seed=plan["seed"]["value"] if "seed" in plan else self.seed,
            attention=_stored_kernel(plan.get("attention"), self.attention, plan["device"]["value"], self.devices),
            activation_checkpointing=checkpointing,
        )


_DEFAULTS = {field.name: field.default for field in dataclasses.fields(RuntimeOptions)}
RESUMED = re.compile(r"^(?:from checkpoint step \d+: )+")  # the notes a resume puts before a stored Plan's reasons


# What a tuned NHWC's Plan row says where it runs through auto's layout (the tune's rule; runtime/tuned.py): a
# resumed run keeps it auto, or its model would hand a loss that views them NHWC outputs
LAID_OUT_BY_AUTO = "laid out as auto lays it: image outputs come back NCHW"


def stored_reason(reason: object) -> str:
    """A stored Plan row's reason as the run that decided it gave it: the notes of resumes since taken off."""
    return RESUMED.sub("", str(reason))


def _stored_kernel(
    stored: Mapping[str, Any] | None, now: AttentionRequest, stored_device: Any, devices: str
) -> AttentionRequest:
    """The attention kernel a stored Plan ran: "auto" where torch picked per call. ``now`` (the request made now) for a
    Plan without it, and for a run moved to another kind of device (``devices``), whose kernels differ."""
    if stored is None or not same_kind(str(stored_device), devices):
        return now
    value = stored.get("value")
    return cast(AttentionRequest, value) if value in get_args(AttentionRequest) else "auto"


def same_kind(stored_device: str, devices: str) -> bool:
    """Whether a resumed run asking for ``devices`` ("auto": the stored one) runs on the kind of device it was on."""
    return devices == "auto" or devices.split(":")[0] == stored_device.split(":")[0]
